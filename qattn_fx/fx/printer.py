"""A compact, stable text form of an FX graph: one line per node, for goldens and debug dumps.

Dynamo names placeholders after module paths and numbers its nodes by trace order, which changes between torch
releases. This printer renames every node that qattn_fx did not insert (``in0..`` for inputs, ``v0..`` for the
rest), keeps the names of the nodes qattn_fx inserted (``blocks_0_attn1_q_quant``: ``meta["qattn_fx_site"]``),
prints targets without their Python module (``qattn.quantize_per_block``, ``linear``, ``.permute``), and annotates
tensor values with dtype and shape.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .match import example_value

_SHORT_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8",
    torch.float8_e4m3fn: "f8e4m3", torch.float8_e8m0fnu: "f8e8m0", torch.int64: "i64", torch.bool: "b8",
}


def _target(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return f".{target}"
    if node.op == "call_module":
        return f"module[{target}]"
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        name = target.name()  # e.g. qattn::quantize_per_block
        return name.replace("::", ".")
    return getattr(target, "__name__", str(target))


def _annotation(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = _SHORT_DTYPES.get(value.dtype, str(value.dtype).replace("torch.", ""))
        return f"{dtype}[{','.join(str(d) for d in value.shape)}]"
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "(" + ", ".join(_annotation(v) for v in value) + ")"
    return ""


def format_graph(gm: fx.GraphModule, *, keep_prefix: str = "qattn") -> str:
    names: dict[fx.Node, str] = {}
    counters = {"in": 0, "v": 0}

    def name_of(node: fx.Node) -> str:
        if node not in names:
            if "qattn_fx_site" in node.meta or node.name.startswith(keep_prefix):
                names[node] = node.name
            else:
                kind = "in" if node.op == "placeholder" else "v"
                names[node] = f"{kind}{counters[kind]}"
                counters[kind] += 1
        return names[node]

    def fmt(arg) -> str:
        if isinstance(arg, fx.Node):
            return name_of(arg)
        if isinstance(arg, (tuple, list)):
            inner = ", ".join(fmt(a) for a in arg)
            return f"({inner}{',' if len(arg) == 1 and isinstance(arg, tuple) else ''})" if isinstance(arg, tuple) \
                else f"[{inner}]"
        if isinstance(arg, float):
            return f"{arg:.6g}"
        if isinstance(arg, torch.dtype):
            return str(arg)
        if isinstance(arg, dict):
            return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in arg.items()) + "}"
        return repr(arg)

    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{name_of(node)}: {_annotation(example_value(node))}".rstrip(": "))
            continue
        if node.op == "output":
            lines.append(f"return {fmt(node.args[0])}")
            continue
        if node.op == "get_attr":
            lines.append(f"{name_of(node)} = get_attr {node.target}")
            continue
        args = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
        note = _annotation(example_value(node))
        lines.append(f"{name_of(node)} = {_target(node)}({', '.join(args)})" + (f"  # {note}" if note else ""))
    return "\n".join(lines)
