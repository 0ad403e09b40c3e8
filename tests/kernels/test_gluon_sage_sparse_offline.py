"""gluon_sage's block-sparse kernels (``SPARSE``, :mod:`qattn_fx.block_sparse`) compiled offline for sm_90.

With Triton's bundled ptxas (no GPU): every two-consumer config that serves block-sparse calls
(:data:`gluon_sage.SPARSE_TUNED_CONFIGS`, :data:`SPARSE_SKIP_TUNED_CONFIGS` and the key-order classes' configs)
builds its sparse kernel, warp-specialized, without spilling; ``trio`` and ``quad`` are refused. The dense kernel's
PTX is unchanged by the ``SPARSE`` constexpr (``tools/ptx_compare.py`` against the commit before it). Numerics:
tests/gpu/test_gluon_sage_sparse.py.
"""

from __future__ import annotations

import pytest
import torch

from qattn_fx.kernels import gluon_sage as gs
from qattn_fx.kernels._offline import ptxas_report

pytest.importorskip("triton.experimental.gluon")


def _meta_inputs(d=128, s=4096, h=4, qk="int8", k_block=16):
    dtype = {"int8": torch.int8, "bf16q": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[qk]
    q = torch.empty(1, s, h, d, dtype=torch.bfloat16 if qk == "bf16q" else dtype, device="meta").transpose(1, 2)
    k = torch.empty(1, s, h, d, dtype=dtype, device="meta").transpose(1, 2)
    v = torch.empty(1, h, d, s, dtype=torch.float8_e4m3fn, device="meta").transpose(-1, -2)
    qs = None if qk in ("bf16q", "bf16") else torch.empty(1, h, s, device="meta")
    ks = None if qk == "bf16" else torch.empty(1, h, -(-s // k_block), device="meta")
    blocks = (0, 0) if qk == "bf16" else (1, k_block)
    return q, qs, k, ks, v, torch.empty(1, h, d, device="meta"), *blocks


def _compile(config, qk="int8", k_block=16, d=128, bias=False, lse=False, tail=False, skip=0, sparse=True):
    q, qs, k, ks, v, vs, qb, kb = _meta_inputs(d=d, qk=qk, k_block=k_block)
    key_bias = torch.empty(1, k.shape[2], device="meta") if bias else None
    split = gs.tail_split.TailPlan(ctas=100, main=60, splits=4, kv_split=1024) if tail else None
    return gs.compile_for(gs.GluonConfig.parse(str(config)), q, qs, k, ks, v, vs, qb, kb, return_lse=lse, tail=split,
                          key_bias=key_bias, skip=skip, sparse=sparse)


CASES = [  # (config, options): the configs that serve block-sparse calls, over the launch classes they meet
    (gs.SPARSE_TUNED_CONFIGS[0], dict()),
    (gs.SPARSE_TUNED_CONFIGS[1], dict(qk="fp8", lse=True)),
    (gs.SPARSE_TUNED_CONFIGS[0], dict(qk="bf16q", bias=True)),
    (gs.SPARSE_TUNED_CONFIGS[0], dict(tail=True)),
    (gs.SPARSE_TUNED_CONFIGS[0], dict(tail=True, bias=True, lse=True)),
    (gs.SPARSE_SKIP_TUNED_CONFIGS[0], dict(skip=2)),
    (gs.SPARSE_SKIP_TUNED_CONFIGS[1], dict(skip=1, lse=True)),
    (gs.KEY_ORDER_TUNED_CONFIGS[0], dict(k_block=1)),
    (gs.KEY_ORDER_TUNED_CONFIGS[1], dict(qk="bf16", d=64, tail=True)),
    (gs.SKIP_KEY_ORDER_TUNED_CONFIGS[0], dict(k_block=1, bias=True, skip=2)),
]


@pytest.mark.parametrize("config,options", CASES, ids=[f"{c}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                                                       for c, o in CASES])
def test_sparse_kernels_compile_warp_specialized_without_spills(config, options):
    compiled = _compile(config, **options)
    ptx = compiled.asm["ptx"]
    assert "setmaxnreg" in ptx and "wgmma" in ptx
    report = ptxas_report(compiled, (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] == 0, report


def test_key_order_sparse_kernel_with_per_key_scales_and_a_key_bias_spills_one_register():
    """Key order, K scales per key and a key bias: the list pointer the biased tiles read stays live through the
    unbiased loop, and ptxas spills one register (a lane index it reloads per tile) where the dense kernel spills
    none. A bound, so that a change that grows it shows."""
    report = ptxas_report(_compile(gs.KEY_ORDER_TUNED_CONFIGS[0], k_block=1, bias=True), (9, 0))
    assert report["ptxas_ok"] and report["spill_stores"] <= 8, report


def test_the_dense_kernel_takes_no_list_arguments():
    """``SPARSE = 0``: the lists are ``None`` (constexprs), so the dense kernel's parameters are those it had."""
    dense = _compile(gs.SPARSE_TUNED_CONFIGS[0], sparse=False).asm["ptx"]
    sparse = _compile(gs.SPARSE_TUNED_CONFIGS[0]).asm["ptx"]
    params = lambda ptx: ptx.count(".param .")  # noqa: E731
    assert params(sparse) == params(dense) + 2  # block_index, block_count (no bounds without tail or bias)


@pytest.mark.parametrize("config", [str(gs.TRIO_DEFAULT_CONFIG), str(gs.QUAD_TUNED_CONFIGS[0])])
def test_compile_refuses_trio_and_quad_for_sparse_calls(config):
    with pytest.raises(ValueError, match=r"cannot run block-sparse calls.*valid: two-consumer configs"):
        _compile(config, d=64)
