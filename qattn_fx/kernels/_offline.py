"""Offline compilation of qattn_fx's Triton/Gluon kernels (no GPU needed): the launch signature Triton would
specialize for given arguments, ptxas' register/spill report and the SASS (Triton's bundled nvdisasm). Used by
``compile_for`` in :mod:`qattn_fx.kernels.triton_sage` and :mod:`qattn_fx.kernels.gluon_sage` for CI checks and SASS
inspection.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch

#: Triton's names for the tensor dtypes the kernels take.
TRITON_TYPES = {torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bfloat16: "bf16",
                torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32"}


def launch_signature(kernel, args: list, meta: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` for ``triton.compile`` of ``kernel`` launched with positional ``args``
    and keyword ``meta``, specialized like a real launch: tensors are pointers taken as 16-byte aligned; ints
    equal to 1 become constants and multiples of 16 carry the divisibility hint; tensor descriptors (in ``args``
    or ``meta``) are specialized by Triton itself; other ``meta`` values, ``None`` and parameters past ``args`` that
    ``meta`` does not name (their default is ``None``) are constexprs."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(p.name for p in kernel.params):
        value = meta[name] if name in meta else args[i] if i < len(args) else None  # trailing None defaults
        if value is None or (name in meta and isinstance(value, (bool, int, float, str))):
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int) and value == 1:
            signature[name] = "constexpr"
            constexprs[(i,)] = 1
        elif isinstance(value, int) and not -2**31 <= value < 2**31:
            signature[name] = "i64"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:  # a host tensor descriptor
            signature[name] = native_specialize_impl(BaseBackend, value, False, True, True)[0]
    return signature, constexprs, attrs


def compile_offline(kernel, args: list, meta: dict, capability: tuple[int, int], options: dict, *,
                    gluon: bool = False):
    """``triton.compile`` of ``kernel`` (a ``@triton.jit`` function, or ``@gluon.jit`` with ``gluon``) for
    ``capability`` as launched with ``args`` and ``meta`` (:func:`launch_signature`), ``options`` (``num_warps``,
    ``num_stages``, ``maxnreg``) as the launch passes them. Returns Triton's compiled kernel (``.asm["ttgir" | "ptx" |
    "cubin"]``, ``.metadata``); needs Triton's bundled ptxas, not a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: N814

    signature, constexprs, attrs = launch_signature(kernel, args, meta)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32), options=options)


def _bundled_tool(name: str) -> str:
    """Path of one of the CUDA tools Triton ships (``ptxas``, ``nvdisasm``, ...)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_report(compiled, capability: tuple[int, int]) -> dict:
    """Registers and spill bytes of a compiled kernel, from Triton's bundled ``ptxas -v``."""
    ptxas = _bundled_tool("ptxas")
    arch = f"sm_{capability[0]}{capability[1]}" + ("a" if capability[0] >= 9 else "")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        res = subprocess.run([ptxas, "-v", f"-arch={arch}", f.name, "-o", os.devnull], capture_output=True, text=True)
    text = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill_st = re.search(r"(\d+) bytes spill stores", text)
    spill_ld = re.search(r"(\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill_st.group(1)) if spill_st else None,
            "spill_loads": int(spill_ld.group(1)) if spill_ld else None,
            "shared_bytes": compiled.metadata.shared, "ptxas_ok": res.returncode == 0}


def sass_opcodes(compiled) -> list[str]:
    """The compiled kernel's SASS, one ``"OPCODE operands"`` string per instruction in address order (predicates
    dropped), from the cubin through Triton's bundled ``nvdisasm``."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([_bundled_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            out.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)))
    return out
