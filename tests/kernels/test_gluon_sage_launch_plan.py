"""gluon_sage's launch plans without a GPU: what the host computes once per layout (``plan.GEOMETRIES``, the
checked layouts) gives exactly the arguments and constexprs of the plain computation, on every call.

:func:`_reference_plan` is the plan computed from scratch on every call (descriptors built by Gluon's checking
constructor); :func:`gluon_sage.plan_launch` must equal it argument for argument on the first call of a layout and
on later calls with other tensors of that layout: tensors by identity, descriptors field by field (their bases by
data pointer, shape, strides and dtype), numbers by type and value. The input checks, which also run once per
layout, still raise on every bad call. Numerics are tested on the H200 (tests/gpu/test_gluon_sage.py).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from qattn_fx.kernels import _sage_common as common
from qattn_fx.kernels._cuda_utils import bias_stride
from qattn_fx.kernels import gluon_sage as gs
from qattn_fx.kernels import q_quantized_in_kernel
from qattn_fx.kernels.gluon_sage import descriptors, launch
from qattn_fx.kernels.gluon_sage import plan as gs_plan

pytest.importorskip("triton.experimental.gluon")

TRIO = gs.GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1)  # the permk class's default
AHEAD = gs.GluonConfig(128, 3, ahead=1, mmasum=1)  # the key-order class's
PERSIST = gs.GluonConfig(128, 3, permk=1, tarrive=1, mmasum=1, trio=1, persist=1)  # its persistent candidate
SERIAL = gs.GluonConfig(128, 3, mmasum=1)  # a Skip-Softmax key-order config


def _reference_plan(q, q_scale, k, k_scale, v, v_scale, q_block, k_block, sm_scale, out, lse, return_lse, config,
                    tail=None, workspace=None, key_bias=None, skip=None, key_range=None, blocks=None):
    """``(grid, args, meta)`` of one launch, every value computed from the tensors on this call."""
    bsz, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    quant_q = q_quantized_in_kernel(q.dtype, k.dtype)
    qs = q if quant_q else q_scale if q_scale is not None else v_scale
    ks = k_scale if k_scale is not None else v_scale
    q_strides = q.stride()[:3] if quant_q else common.scale_strides(q_scale)
    ks_box = gs.k_scale_box(k_scale, k_block, config.block_n)
    # gs.permuted_k builds its descriptor over this k on every call (the view's geometry it caches is a pure
    # function of k's shape, strides and element size)
    permuted = (gs.permuted_k(k, k_block if k_scale is not None else 0, config.block_n)
                if config.permk else None)
    kp_desc, kp_xh, kp_gb, kp_gh = permuted if permuted else (None, 0, 0, 0)
    n_m = gs.q_blocks(sq, config)
    args = [
        gs.descriptor(q, [1, 1, gs.ROWS_PER_CONSUMER, d]), gs.descriptor(k, [1, 1, config.block_n, d]),
        gs.descriptor(v.transpose(2, 3), [1, 1, dv, config.block_n]),
        descriptors.k_scale_descriptor(k_scale, ks_box) if ks_box else None, kp_desc,
        qs, ks, v_scale, key_bias if key_bias is not None else v_scale, key_range if key_range is not None else v_scale,
        out, lse, float(sm_scale) * common.LOG2E,
        *q_strides, *common.scale_strides(k_scale), *common.scale_strides(v_scale),
        bias_stride(key_bias),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, sq, skv, kp_xh, kp_gb, kp_gh,
        n_m, tail.main if tail else 0, tail.splits if tail else 1, tail.kv_split if tail else 0,
        *(workspace if tail else (out, lse)),
        *((skip[0], skip[1] if skip[1] is not None else skip[0]) if skip is not None else (v_scale, v_scale)),
        (tail.grid if tail else n_m * bsz * hq) if config.persist else None,  # the work items of a persistent grid
        *(blocks if blocks is not None else (None, None, None)),
    ]
    meta = dict(QK_KIND=common.QK_KIND[k.dtype], Q_BLOCK=q_block if q_scale is not None or quant_q else 0,
                K_BLOCK=k_block if k_scale is not None else 0, RETURN_LSE=return_lse,
                BLOCK_N=config.block_n, STAGES=config.stages,
                CONSUMER_NREG=gs.REGISTERS[config.consumers][1],
                PRODUCER_NREG=gs.PRODUCER_REGS,
                AHEAD=config.ahead, KS_TMA=int(ks_box is not None),
                PERMK=int(permuted is not None), CONSUMERS=config.consumers, TARRIVE=config.tarrive,
                MMASUM=config.mmasum, SPLIT_TAIL=int(tail is not None), HAS_BIAS=int(key_bias is not None),
                SKIP=0 if skip is None else (2 if skip[1] is not None else 1), SPARSE=int(blocks is not None),
                PERSIST=config.persist, PAIR=config.pair)
    if config.persist:  # (no GPU here: one CTA per work item)
        grid = (tail.grid if tail else n_m * bsz * hq,)
    else:
        grid = (tail.grid,) if tail else (n_m, bsz * hq)
    return grid, args, meta


def _same_tensor(got, want) -> bool:
    return (got.data_ptr(), got.shape, got.stride(), got.dtype) == (want.data_ptr(), want.shape, want.stride(),
                                                                     want.dtype)


def _assert_same_value(got, want, where, identical=True):
    """Descriptors field by field (bases by :func:`_same_tensor`), tensors by identity (``identical``) or by
    :func:`_same_tensor`, anything else by type and value."""
    if isinstance(want, descriptors.TensorDescriptor):
        assert type(got) is type(want) and _same_tensor(got.base, want.base), where
        for field in ("shape", "strides", "block_shape", "layout", "padding"):
            g, w = getattr(got, field), getattr(want, field)
            assert type(g) is type(w) and g == w, (where, field, g, w)
            if isinstance(w, list):
                assert [type(x) for x in g] == [type(x) for x in w], (where, field)
    elif isinstance(want, torch.Tensor):
        assert got is want if identical else _same_tensor(got, want), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def _assert_plan_is_reference(plan, reference, identical=True):
    grid, args, meta = reference
    assert plan.grid == grid and len(plan.args) == len(args)
    for i, (got, want) in enumerate(zip(plan.args, args)):
        _assert_same_value(got, want, f"argument {i}", identical)
    assert list(plan.meta) == list(meta)
    for name in meta:
        _assert_same_value(plan.meta[name], meta[name], name)


def _inputs(case: str, b=1, h=4, s=2048, d=128):
    """``(q, q_scale, k, k_scale, v, v_scale, q_block, k_block)`` on the CPU in the layouts the quantize nodes give:
    BSHD Q/K views, sequence-major V padded to 16 tokens, scales ``(B, H, blocks)``."""
    kind, _, rest = case.partition(":")
    qk = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "qbf16": torch.int8}[kind]
    q_block, k_block = (0, 0) if kind == "bf16" else (1, int(rest) if rest.isdigit() else 16)
    s16 = -(-s // 16) * 16
    bshd = lambda dtype: torch.zeros(b, s, h, d, dtype=dtype).transpose(1, 2)  # noqa: E731
    q = bshd(torch.bfloat16 if kind == "qbf16" else qk)
    k = torch.zeros(b, h, s, d, dtype=qk) if case.endswith("bhsd") else bshd(qk)
    v = torch.zeros(b, h, d, s16).to(torch.float8_e4m3fn).transpose(-1, -2)
    v_scale = torch.ones(1, h, d)
    if kind == "bf16":
        return q, None, k, None, v, v_scale, 0, 0
    q_scale = None if kind == "qbf16" else torch.ones(b, h, s)
    k_scale = (torch.ones(1, 1, 1) if k_block == 0 else
               torch.ones(b, h, s // k_block + 1)[..., 1:] if rest == "offset" else torch.ones(b, h, -(-s // k_block)))
    return q, q_scale, k, k_scale, v, v_scale, q_block, k_block


def _outputs(q, v, return_lse, tail, config, key_bias_rows=0, bhsd_out=False):
    b, h, sq, _ = q.shape
    out = (torch.empty(b, h, sq, v.shape[-1], dtype=torch.bfloat16) if bhsd_out else
           torch.empty(b, sq, h, v.shape[-1], dtype=torch.bfloat16).transpose(1, 2))
    lse = torch.empty(b, h, sq) if return_lse else out
    ws = gs.tail_split.workspace(tail, config.rows, v.shape[-1], "cpu") if tail else None
    bias = torch.zeros(key_bias_rows, q.shape[2]) if key_bias_rows else None
    return out, lse, ws, bias


CASES = [  # (inputs, config, return_lse, tail split, key-bias rows, skip)
    ("int8", TRIO, False, False, 0, None), ("int8", TRIO, True, True, 0, None),
    ("qbf16", TRIO, False, True, 0, None), ("qbf16", TRIO, True, False, 0, None),
    ("bf16", AHEAD, False, False, 0, None), ("bf16", AHEAD, True, True, 0, None),
    ("fp8", TRIO, False, True, 0, None), ("int8:1", AHEAD, False, False, 0, None),
    ("int8:4", AHEAD, True, True, 0, None), ("int8:0", TRIO, False, True, 0, None),
    ("int8:offset", TRIO, False, False, 0, None), ("int8:bhsd", TRIO, True, False, 0, None),
    ("int8", AHEAD, False, True, 1, None), ("qbf16", AHEAD, True, False, 2, None),
    ("int8", TRIO, False, True, 2, None), ("int8:bhsd", TRIO, True, False, 1, None),
    ("int8", TRIO, False, False, 0, "count"), ("qbf16", SERIAL, True, False, 1, "threshold"),
    ("int8", PERSIST, False, False, 0, None), ("int8", PERSIST, True, True, 1, None),
]


def _tail(q, k_block, config):
    ctas = q.shape[0] * q.shape[1] * gs.q_blocks(q.shape[2], config)
    return gs.tail_split.plan(ctas, 20, q.shape[2], config.block_n, k_block)


@pytest.mark.parametrize("case,config,return_lse,split,bias_rows,skip", CASES,
                         ids=[f"{c[0]}-{'trio' if c[1].trio else 'keyorder'}{'-lse' if c[2] else ''}"
                              f"{'-tail' if c[3] else ''}{f'-bias{c[4]}' if c[4] else ''}{f'-{c[5]}' if c[5] else ''}"
                              for c in CASES])
def test_plan_equals_the_plain_computation_on_first_and_later_calls(case, config, return_lse, split, bias_rows, skip):
    b = 2 if bias_rows == 2 or case.endswith("bhsd") else 1
    gs_plan.GEOMETRIES.clear()
    for call in range(3):  # a new layout, then two calls with other tensors of that layout
        q, qs, k, ks, v, vs, qb, kb = _inputs(case, b=b)
        tail = _tail(q, kb if ks is not None else 0, config) if split else None
        assert (tail is not None) == split
        out, lse, ws, bias = _outputs(q, v, return_lse, tail, config, bias_rows)
        skip_args = None if skip is None else (torch.zeros(1), torch.zeros(1, dtype=torch.int32) if skip == "count"
                                               else None)
        common_args = (q, qs, k, ks, v, vs, qb, kb, 0.0883883, out, lse, return_lse, config, tail, ws, bias, skip_args,
                       None if bias is None else common.bias_range(bias))
        plan = gs.plan_launch(*common_args)
        _assert_plan_is_reference(plan, _reference_plan(*common_args))
        assert len(gs_plan.GEOMETRIES) == 1, "one geometry per layout"
    assert gs_plan.GEOMETRIES.misses == 1 and gs_plan.GEOMETRIES.hits == 2


def test_one_cache_serves_every_case():
    """Cases that share a layout but differ in config, flags, tail split, bias or output strides each get their own
    plan."""
    gs_plan.GEOMETRIES.clear()
    for bhsd_out in (False, True, False, True):
        for case, config, return_lse, split, bias_rows, skip in CASES:
            q, qs, k, ks, v, vs, qb, kb = _inputs(case, b=2 if bias_rows == 2 or case.endswith("bhsd") else 1)
            tail = _tail(q, kb if ks is not None else 0, config) if split else None
            out, lse, ws, bias = _outputs(q, v, return_lse, tail, config, bias_rows, bhsd_out)
            skip_args = None if skip is None else (torch.zeros(1), None)
            common_args = (q, qs, k, ks, v, vs, qb, kb, 0.1, out, lse, return_lse, config, tail, ws, bias, skip_args,
                           None if bias is None else common.bias_range(bias))
            _assert_plan_is_reference(gs.plan_launch(*common_args), _reference_plan(*common_args))
    assert gs_plan.GEOMETRIES.misses == 2 * len(CASES)


def test_plans_of_the_offline_compile_are_the_plain_ones_on_meta_tensors():
    """``compile_for``'s meta tensors (data pointers 0) plan as CPU tensors of their layout do."""
    q, qs, k, ks, v, vs, qb, kb = (x.to("meta") if isinstance(x, torch.Tensor) else x for x in _inputs("int8"))
    out, lse, _, _ = _outputs(q, v, False, None, TRIO)
    common_args = (q, qs, k, ks, v, vs, qb, kb, 0.125, out, lse, False, TRIO)
    _assert_plan_is_reference(gs.plan_launch(*common_args), _reference_plan(*common_args))


def test_an_unaligned_base_is_refused_by_gluon_on_every_call():
    """Alignment is part of the geometry's key: a K scale or K whose base is off 16 bytes plans from scratch."""
    q, qs, k, ks, v, vs, qb, kb = _inputs("int8")
    out, lse, _, _ = _outputs(q, v, False, None, TRIO)
    gs_plan.GEOMETRIES.clear()
    gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.1, out, lse, False, TRIO)
    shifted = torch.ones(ks.numel() + 1)[1:].view(ks.shape)  # 4 bytes off: its scales load from global memory
    common_args = (q, qs, k, shifted, v, vs, qb, kb, 0.1, out, lse, False, TRIO)
    plan = gs.plan_launch(*common_args)
    assert plan.k_scale_box is None and plan.meta["KS_TMA"] == 0
    _assert_plan_is_reference(plan, _reference_plan(*common_args))
    odd = torch.zeros(k.numel() + 16, dtype=torch.int8)[1:1 + k.numel()].view(1, 2048, 4, 128).transpose(1, 2)
    for _ in range(2):
        with pytest.raises(AssertionError, match="base must be 16-byte aligned"):
            gs.plan_launch(q, qs, odd, ks, v, vs, qb, kb, 0.1, out, lse, False, TRIO)


def test_cached_geometry_and_checks_keep_no_tensor_alive():
    q, qs, k, ks, v, vs, qb, kb = _inputs("int8")
    out, lse, _, _ = _outputs(q, v, True, None, TRIO)
    refs = [weakref.ref(t) for t in (q, qs, k, ks, v, vs, out, lse)]
    common.validate("gluon_sage", q, qs, k, ks, v, vs, qb, kb)
    plan = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.1, out, lse, True, TRIO)
    del plan, q, qs, k, ks, v, vs, out, lse
    gc.collect()
    assert all(r() is None for r in refs)


@contextlib.contextmanager
def _recorded_launches(monkeypatch):
    """Run ``gs.attention`` on CPU tensors: the device check passes, the launches are recorded instead of run."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, list(args), meta))

    monkeypatch.setattr(launch, "device_reason", lambda device: None)
    monkeypatch.setattr(launch, "_sage_fwd_ws", Kernel())
    monkeypatch.setattr(launch, "sm_count", lambda index: 20)
    monkeypatch.setattr(gs.tail_split, "merge", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    yield launches


@pytest.mark.parametrize("case,config,return_lse,chunked,bias_rows", [
    ("int8", TRIO, False, False, 0), ("qbf16", TRIO, True, False, 0), ("bf16", AHEAD, True, True, 0),
    ("int8", TRIO, True, True, 0), ("int8", TRIO, False, True, 3), ("int8", TRIO, False, True, 1),
    ("int8", PERSIST, True, True, 1),
])
def test_attention_launches_the_plain_plan(monkeypatch, case, config, return_lse, chunked, bias_rows):
    """Whole calls, batch chunks (the grid limit, made small here) included: every launch's grid, arguments and
    meta are the plain plan's on the tensors it received; a key bias's range is taken once per call and each
    chunk gets its rows (equal to the chunk's own :func:`bias_range`)."""
    if chunked:
        monkeypatch.setattr(common, "MAX_GRID_Y", 4)  # B=3, H=4: one batch element per launch
    q, qs, k, ks, v, vs, qb, kb = _inputs(case, b=3 if chunked else 1)
    bias = None
    if bias_rows:
        bias = torch.zeros(bias_rows, k.shape[2])
        for r in range(bias_rows):  # a different masked suffix per row
            bias[r, k.shape[2] - 100 * (r + 1):] = float("-inf")
    ranges, bias_range = [], common.bias_range
    monkeypatch.setattr(common, "bias_range", lambda b: ranges.append(b) or bias_range(b))
    with _recorded_launches(monkeypatch) as launches, gs.use_config(config):
        for _ in range(2):
            launches.clear()
            ranges.clear()
            gs.attention(q, qs, k, ks, v, vs, qb, kb, 0.09, torch.bfloat16, return_lse=return_lse, key_bias=bias)
            assert len(launches) == (3 if chunked else 1)
            assert len(ranges) == (1 if bias_rows else 0) and (not ranges or ranges[0] is bias)
            for i, (grid, args, meta) in enumerate(launches):
                lo, hi = (i, i + 1) if chunked else (0, 1)
                part = [common.batch_chunk(t, lo, hi) for t in (q, qs, k, ks, v, vs, bias)]
                assert args[0].base.data_ptr() == part[0].data_ptr()
                tail = None if meta["SPLIT_TAIL"] == 0 else gs.last_tail_plan()
                ws = tuple(args[-8:-6]) if tail else None
                key_range = None
                if bias is not None:
                    key_range = args[9]
                    assert torch.equal(key_range, bias_range(part[6]))
                reference = _reference_plan(*part[:6], qb, kb, 0.09, args[10], args[11], return_lse, config, tail, ws,
                                            part[6], None, key_range)
                meta = dict(meta)
                assert meta.pop("num_warps") == 4 and meta.pop("maxnreg") == gs_plan.launch_maxnreg(meta)
                _assert_plan_is_reference(gs_plan.LaunchPlan(config, grid, args, meta, None, False, tail, 0),
                                          reference, identical=False)


def test_checks_run_once_per_layout_and_raise_on_every_bad_call():
    """The op's and the kernel's input checks remember layouts that passed, never one that failed."""
    from qattn_fx.ops import attention as ops

    q, qs, k, ks, v, vs, qb, kb = _inputs("int8", s=256)
    bias = torch.zeros(1, 256)
    ops.check_scaled_inputs(q, qs, k, ks, v, vs, qb, kb, torch.bfloat16, "gluon_sage", bias)
    common.validate("gluon_sage", q, qs, k, ks, v, vs, qb, kb, bias)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^key_bias is on meta, k on cpu$"):
            ops.check_scaled_inputs(q, qs, k, ks, v, vs, qb, kb, torch.bfloat16, "gluon_sage", bias.to("meta"))
        with pytest.raises(ValueError, match=r"^gluon_sage: v must be float8_e4m3fn; got torch.int8$"):
            common.validate("gluon_sage", q, qs, k, ks, v.view(torch.int8), vs, qb, kb, bias)
        with pytest.raises(ValueError, match=r"^gluon_sage supports head_dim in .*; got head_dim=96 "):
            common.validate("gluon_sage", q[..., :96], qs, k[..., :96], ks, v[..., :96], vs, qb, kb, bias)


@pytest.mark.parametrize("row,want", [
    ([0.0] * 300, (300, 0)), ([0.0] * 250 + [float("-inf")] * 50, (250, 300)),
    ([0.0] * 10 + [-2.5] + [0.0] * 289, (10, 11)), ([float("nan")] + [0.0] * 299, (0, 1)),
    ([-1e4] * 300, (0, 300)), ([0.0] * 100 + [float("-inf")] * 50 + [0.0] * 150, (100, 150)),
])
def test_bias_range_is_the_span_of_nonzero_keys(row, want):
    """The kernel adds the key bias only in the tiles that meet ``[first, end)``: every key outside has bias 0."""
    bias = torch.tensor([row, [0.0] * 299 + [1.0]])
    got = common.bias_range(bias)
    assert got.dtype == torch.int32 and got.tolist() == [list(want), [299, 300]]


def test_a_key_bias_without_its_range_is_refused():
    q, qs, k, ks, v, vs, qb, kb = _inputs("int8")
    out, lse, _, bias = _outputs(q, v, False, None, TRIO, 1)
    with pytest.raises(ValueError, match=r"^gluon_sage: key_bias and key_range \(its bias_range\) go together; "
                                         r"got key_bias given, key_range None$"):
        gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.1, out, lse, False, TRIO, key_bias=bias)


def test_kernel_meta_names_every_constexpr_of_the_kernel():
    """:func:`gluon_sage.kernel_meta` builds every constexpr of the kernel, from the config and the inputs, and
    the kernel's ``KernelFlags`` take theirs by the same names."""
    from qattn_fx.kernels.gluon_sage.kernel import _sage_fwd_ws
    from qattn_fx.kernels.gluon_sage.state import KernelFlags

    q, qs, k, ks, v, vs, qb, kb = _inputs("int8")
    meta = gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.1, q, None, False, TRIO).meta
    constexprs = [p.name for p in _sage_fwd_ws.params if p.is_constexpr]
    assert sorted(meta) == sorted(constexprs)
    assert set(KernelFlags.FIELDS) <= set(meta)
    inputs = {name: meta[name] for name in ("QK_KIND", "Q_BLOCK", "K_BLOCK", "RETURN_LSE", "KS_TMA", "PERMK",
                                            "SPLIT_TAIL", "HAS_BIAS", "SKIP", "SPARSE")}
    for config in (TRIO, AHEAD, SERIAL):
        flags = gs.kernel_meta(config, **inputs)
        assert {f.upper(): getattr(config, f) for f in config.KERNEL_FLAGS}.items() <= flags.items()
        assert flags["CONSUMERS"] == config.consumers and flags["BLOCK_N"] == config.block_n


# ---- block sparsity (qattn_fx.block_sparse): two-consumer configs, lists as the last arguments, tail at 128 keys --

SPARSE = gs.SPARSE_TUNED_CONFIGS[0]  # the permk class's two-consumer default


def _lists(q, k, density=0.5, seed=0):
    """Random block lists for a call of these Q and K (:func:`qattn_fx.block_sparse.from_mask`)."""
    from qattn_fx import block_sparse

    nq, nk = block_sparse.tiles(q.shape[2], k.shape[2])
    gen = torch.Generator().manual_seed(seed)
    return tuple(block_sparse.from_mask(torch.rand(q.shape[0], q.shape[1], nq, nk, generator=gen) < density))


@pytest.mark.parametrize("case,config,return_lse,split,bias_rows,skip", [
    ("int8", SPARSE, False, False, 0, None), ("int8", SPARSE, True, True, 1, None),
    ("qbf16", AHEAD, True, True, 0, None), ("fp8", SPARSE, False, False, 2, None),
    ("int8", gs.SPARSE_SKIP_TUNED_CONFIGS[0], False, False, 0, "count"),
    ("int8", gs.SPARSE_PERSIST_CONFIGS[0], False, False, 0, None),
    ("int8", gs.SPARSE_PERSIST_CONFIGS[1], True, True, 1, None),
    ("int8", gs.GluonConfig.parse("128,3,permk,tarrive,mmasum,pair"), True, True, 0, None),
])
def test_sparse_plan_passes_the_lists_last_with_the_sparse_constexpr(case, config, return_lse, split, bias_rows,
                                                                      skip):
    b = 2 if bias_rows == 2 else 1
    gs_plan.GEOMETRIES.clear()
    for call in range(2):
        q, qs, k, ks, v, vs, qb, kb = _inputs(case, b=b)
        blocks = _lists(q, k, seed=call)
        tail = _tail(q, kb if ks is not None else 0, config) if split else None
        assert tail is None or tail.kv_split % 128 == 0
        out, lse, ws, bias = _outputs(q, v, return_lse, tail, config, bias_rows)
        skip_args = None if skip is None else (torch.zeros(1), torch.zeros(1, dtype=torch.int32))
        key_range = None if bias is None else common.bias_range(bias)
        common_args = (q, qs, k, ks, v, vs, qb, kb, 0.0883883, out, lse, return_lse, config, tail, ws, bias, skip_args,
                       key_range)
        blocks += (launch.visit_bounds(*blocks, tail, key_range),)
        assert (blocks[2] is None) == (tail is None and bias is None)
        plan = gs.plan_launch(*common_args, blocks)
        _assert_plan_is_reference(plan, _reference_plan(*common_args, blocks))
        assert plan.meta["SPARSE"] == 1 and all(a is b for a, b in zip(plan.args[-3:], blocks))
        with pytest.raises(ValueError, match=r"takes \d+ visit bounds per query tile"):
            gs.plan_launch(*common_args, blocks[:2] + (None if blocks[2] is not None else blocks[0],))
        dense = gs.plan_launch(*common_args)  # its own geometry: no lists, SPARSE 0
        assert dense.meta["SPARSE"] == 0 and dense.args[-3:] == [None, None, None]
    assert len(gs_plan.GEOMETRIES) == 2


@pytest.mark.parametrize("config", [str(gs.TRIO_DEFAULT_CONFIG), str(gs.QUAD_TUNED_CONFIGS[0]), "128,2,trio",
                                    "64,3,ahead,mmasum"])
def test_sparse_launches_refuse_trio_quad_and_64_key_tiles_naming_the_valid_configs(config, monkeypatch):
    q, qs, k, ks, v, vs, qb, kb = _inputs("int8")
    cfg = gs.GluonConfig.parse(config)
    out, lse, _, _ = _outputs(q, v, False, None, cfg)
    message = (rf"^gluon_sage config {cfg} \({cfg.consumers} consumers, {cfg.rows} query rows per CTA, "
               rf"{cfg.block_n}-key tiles\) cannot run block-sparse calls, .* valid: two-consumer configs with "
               rf"block_n 128 \(no 'trio', no 'quad'\), e\.g\. '{gs.SPARSE_TUNED_CONFIGS[0]}'")
    with pytest.raises(ValueError, match=message):
        gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.1, out, lse, False, cfg, blocks=_lists(q, k) + (None,))
    with _recorded_launches(monkeypatch) as launches, gs.use_config(cfg), pytest.raises(ValueError, match=message):
        gs.attention(q, qs, k, ks, v, vs, qb, kb, 0.1, torch.bfloat16, block_index=_lists(q, k)[0],
                     block_count=_lists(q, k)[1])
    assert not launches


def test_sparse_plan_refuses_a_tail_not_cut_at_128_keys():
    q, qs, k, ks, v, vs, qb, kb = _inputs("int8")
    config = SPARSE
    tail = gs.tail_split.TailPlan(ctas=64, main=60, splits=4, kv_split=576)
    out, lse, ws, _ = _outputs(q, v, False, tail, config)
    with pytest.raises(ValueError, match=r"splits the tail at multiples of 128 keys .*; got kv_split=576$"):
        gs.plan_launch(q, qs, k, ks, v, vs, qb, kb, 0.1, out, lse, False, config, tail, ws,
                       blocks=_lists(q, k) + (None,))


@pytest.mark.parametrize("s,k_block", [(2048, 16), (4608, 16), (4100, 64), (32760, 1), (6000, 0)])
def test_sparse_tail_pieces_start_on_128_key_tiles(monkeypatch, s, k_block):
    """The tail split of a block-sparse launch cuts the keys at multiples of 128 (and of ``k_block``): each piece
    visits whole listed tiles (``emulate_launched``'s pieces)."""
    monkeypatch.setattr(launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q = torch.empty(1, 3, s, 128, dtype=torch.int8)
    for config in (gs.GluonConfig(64, 3, ahead=1, mmasum=1), SPARSE):
        tail = gs.tail_plan(q, q, k_block, config, sparse=True)
        if tail is not None:
            assert tail.kv_split % 128 == 0 and (k_block == 0 or tail.kv_split % k_block == 0)
    dense64 = {gs.tail_plan(torch.empty(1, 3, n, 128, dtype=torch.int8), torch.empty(1, 3, n, 128, dtype=torch.int8),
                            16, gs.GluonConfig(64, 3, ahead=1, mmasum=1)) for n in range(2048, 6000, 64)}
    assert any(t is not None and t.kv_split % 128 for t in dense64)  # (what the sparse plan avoids)


@pytest.mark.parametrize("chunked", [False, True])
def test_attention_passes_each_chunk_its_lists(monkeypatch, chunked):
    if chunked:
        monkeypatch.setattr(common, "MAX_GRID_Y", 4)  # B=3, H=4: one batch element per launch
    q, qs, k, ks, v, vs, qb, kb = _inputs("int8", b=3)
    index, count = _lists(q, k)
    monkeypatch.setattr(gs.SPARSE_TUNER, "choose", lambda key, run: gs.SPARSE_TUNER.default(key))  # (no timing)
    with _recorded_launches(monkeypatch) as launches:
        gs.attention(q, qs, k, ks, v, vs, qb, kb, 0.09, torch.bfloat16, block_index=index, block_count=count)
    assert gs.last_config() == gs.SPARSE_TUNED_CONFIGS[0]
    assert len(launches) == (3 if chunked else 1)
    for i, (grid, args, meta) in enumerate(launches):
        lo, hi = (i, i + 1) if chunked else (0, 3)
        assert meta["SPARSE"] == 1 and meta["CONSUMERS"] == 2
        assert torch.equal(args[-3], index[lo:hi]) and torch.equal(args[-2], count[lo:hi])
        tail = gs.last_tail_plan() if meta["SPLIT_TAIL"] else None
        assert (args[-1] is None) == (tail is None)
        if tail is not None:
            assert torch.equal(args[-1], launch.visit_bounds(index[lo:hi], count[lo:hi], tail, None))
    with pytest.raises(ValueError, match=r"block_count must have shape \(3, 4, 16\)"):
        gs.attention(q, qs, k, ks, v, vs, qb, kb, 0.09, torch.bfloat16, block_index=index, block_count=count[:, :, 1:])
    with pytest.raises(ValueError, match=r"block_index and block_count go together"):
        gs.attention(q, qs, k, ks, v, vs, qb, kb, 0.09, torch.bfloat16, block_index=index)


@pytest.mark.parametrize("case,skip,bias,tuner", [
    ("int8", False, False, "SPARSE_TUNER"), ("int8", False, True, "SPARSE_TUNER"),
    ("int8", True, False, "SPARSE_SKIP_TUNER"), ("int8", True, True, "SKIP_KEY_ORDER_TUNER"),
    ("int8:1", False, False, "SPARSE_KEY_ORDER_TUNER"), ("int8:1", True, False, "SKIP_KEY_ORDER_TUNER"),
    ("bf16", False, False, "SPARSE_KEY_ORDER_TUNER"),
])
def test_sparse_launches_tune_among_two_consumer_configs(case, skip, bias, tuner):
    q, qs, k, ks, v, vs, qb, kb = _inputs(case)
    key_bias = torch.zeros(1, k.shape[2]) if bias else None
    chosen = gs.tuner_for(k, ks, kb, key_bias, skip, sparse=True)
    assert chosen is getattr(gs, tuner)
    configs = [gs.GluonConfig.parse(c) for c in chosen.candidates + [chosen.default((128,)), chosen.default((64,))]]
    assert all(c.consumers == 2 for c in configs)
    key = gs.tuning_key(q, k, qb, kb, False, bias, skip, sparse=True)
    assert key[-1] == "sparse" and key[:-1] == gs.tuning_key(q, k, qb, kb, False, bias, skip)


def test_visit_bounds_are_the_list_positions_of_the_piece_cuts_and_the_bias_span():
    """Piece ``s`` of a split query tile visits list positions ``[bounds[s], bounds[s + 1])`` (its key tiles); the
    visits ``[bounds[-2], bounds[-1])`` meet the key bias's nonzero span."""
    from qattn_fx import block_sparse

    gen = torch.Generator().manual_seed(1)
    index, count = block_sparse.from_mask(torch.rand(2, 3, 5, 20, generator=gen) < 0.4)
    tail = gs.tail_split.TailPlan(ctas=30, main=20, splits=3, kv_split=896)
    bias = torch.zeros(2, 20 * 128 - 50)
    bias[0, 1000:2000] = -1.0
    bias[1, -10:] = float("-inf")
    key_range = common.bias_range(bias)
    bounds = launch.visit_bounds(index, count, tail, key_range)
    assert bounds.dtype == torch.int32 and bounds.shape == (2, 3, 5, 6)
    for b, h, i in ((b, h, i) for b in range(2) for h in range(3) for i in range(5)):
        listed = index[b, h, i, :count[b, h, i]].tolist()
        below = lambda tile: sum(x < tile for x in listed)  # noqa: E731
        span = key_range[b].tolist()
        want = [below(c) for c in (0, 7, 14, 21)] + [below(span[0] // 128), below(-(-span[1] // 128))]
        assert bounds[b, h, i].tolist() == want
    assert launch.visit_bounds(index, count, None, None) is None
    assert launch.visit_bounds(index, count, None, key_range[:1]).shape == (2, 3, 5, 2)  # a broadcast bias row
