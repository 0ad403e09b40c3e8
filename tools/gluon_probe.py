"""The Gluon building blocks of gluon_sage, one at a time on an sm_90 GPU, against torch.

When to use: when gluon_sage (or a change to it) gives wrong values and the GPU tests do not say which piece is at
fault, or after a Triton upgrade, before suspecting the schedule. Each probe is a one-CTA Gluon kernel built from
gluon_sage's own layouts and TMA descriptors: TMA + wgmma Q·Kᵀ (int8, e4m3, bf16; 128- and 64-key tiles), Q·Kᵀ
from either slot of a 2-deep shared-memory ring, and the FP8 P·V wgmma with P from registers or from shared memory
(printing which V key each P column meets when P·V is wrong). It prints every probe's max error::

    python -m tools.gluon_probe
"""
import argparse
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from qattn_fx.kernels import gluon_sage as gs


@gluon.jit
def probe_qk(q_desc, k_desc, S, BN: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    s_layout: gl.constexpr = gs.mma_layout(4, BN, q_desc.dtype.primitive_bitwidth)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [0, 0, 0, 0], bar, q_smem)
    tma.async_copy_global_to_shared(k_desc, [0, 0, 0, 0], bar, k_smem)
    mbarrier.wait(bar, 0)
    if q_desc.dtype == gl.int8:
        acc = gl.zeros([BM, BN], gl.int32, s_layout)
    else:
        acc = gl.zeros([BM, BN], gl.float32, s_layout)
    s = warpgroup_mma(q_smem.reshape([BM, D]), k_smem.reshape([BN, D]).permute((1, 0)), acc, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    gl.store(S + offs_m[:, None] * BN + offs_n[None, :], s.to(gl.float32))


@gluon.jit
def probe_qk_ring(q_desc, k_desc, S, BN: gl.constexpr, SLOT: gl.constexpr):
    """Like probe_qk with K in slot ``SLOT`` of a 2-deep ring (5-D allocation, as in the kernel)."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    s_layout: gl.constexpr = gs.mma_layout(4, BN, q_desc.dtype.primitive_bitwidth)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [0, 0, 0, 0], bar, q_smem.index(SLOT))
    tma.async_copy_global_to_shared(k_desc, [0, 0, 0, 0], bar, k_smem.index(SLOT))
    mbarrier.wait(bar, 0)
    acc = gl.zeros([BM, BN], gl.int32, s_layout)
    s = warpgroup_mma(q_smem.index(SLOT).reshape([BM, D]), k_smem.index(SLOT).reshape([BN, D]).permute((1, 0)),
                      acc, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    gl.store(S + offs_m[:, None] * BN + offs_n[None, :], s.to(gl.float32))


@gluon.jit
def probe_pv(P, v_desc, O, BM: gl.constexpr, BN: gl.constexpr, VIA_SMEM: gl.constexpr):
    DV: gl.constexpr = v_desc.block_type.shape[2]
    s_layout: gl.constexpr = gs.mma_layout(4, BN, 8)
    o_layout: gl.constexpr = gs.mma_layout(4, DV, 8)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    p = gl.load(P + offs_m[:, None] * BN + offs_n[None, :])
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [0, 0, 0, 0], bar, v_smem)
    mbarrier.wait(bar, 0)
    zero = gl.zeros([BM, DV], gl.float32, o_layout)
    b_op = v_smem.reshape([DV, BN]).permute((1, 0))
    if VIA_SMEM:
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, BN],
                                           gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float8e4nv))
        p_smem.store(p)
        fence_async_shared()
        o = warpgroup_mma(p_smem, b_op, zero, use_acc=False, is_async=True)
    else:
        o = warpgroup_mma(gl.convert_layout(p, p_layout), b_op, zero, use_acc=False, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    offs_mo = gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + offs_mo[:, None] * DV + offs_d[None, :], o)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m tools.gluon_probe", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("tools.gluon_probe needs an sm_90 GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    BM, D = 64, 128
    for dt, BN in ((torch.int8, 128), (torch.float8_e4m3fn, 128), (torch.bfloat16, 128), (torch.int8, 64)):
        if dt == torch.int8:
            q = torch.randint(-127, 128, (1, 1, BM, D), dtype=torch.int8, device="cuda")
            k = torch.randint(-127, 128, (1, 1, BN, D), dtype=torch.int8, device="cuda")
        else:
            q = torch.randn(1, 1, BM, D, device="cuda").to(dt)
            k = torch.randn(1, 1, BN, D, device="cuda").to(dt)
        S = torch.empty(BM, BN, device="cuda")
        probe_qk[(1,)](gs.descriptor(q, [1, 1, BM, D]), gs.descriptor(k, [1, 1, BN, D]), S, BN, num_warps=4)
        ref = q[0, 0].double() @ k[0, 0].double().T
        print(f"probe_qk {dt} BN{BN}: max abs err {(S.double() - ref).abs().max().item():.3e} "
              f"(ref max {ref.abs().max().item():.1f})", flush=True)
    for slot in (0, 1):
        q = torch.randint(-127, 128, (1, 1, BM, D), dtype=torch.int8, device="cuda")
        k = torch.randint(-127, 128, (1, 1, 128, D), dtype=torch.int8, device="cuda")
        S = torch.empty(BM, 128, device="cuda")
        probe_qk_ring[(1,)](gs.descriptor(q, [1, 1, BM, D]), gs.descriptor(k, [1, 1, 128, D]), S, 128, slot,
                            num_warps=4)
        ref = q[0, 0].double() @ k[0, 0].double().T
        print(f"probe_qk_ring slot {slot}: max abs err {(S.double() - ref).abs().max().item():.3e}", flush=True)
    for BN, via in ((128, False), (128, True), (64, False)):
        p = (torch.rand(BM, BN, device="cuda") * 448).to(torch.float8_e4m3fn)
        v_seq = torch.randn(1, 1, D, BN, device="cuda").to(torch.float8_e4m3fn)  # (B, H, Dv, S) storage
        O = torch.empty(BM, D, device="cuda")
        probe_pv[(1,)](p, gs.descriptor(v_seq, [1, 1, D, BN]), O, BM, BN, via, num_warps=4)
        ref = p.double() @ v_seq[0, 0].double().T
        err = (O.double() - ref).abs().max().item() / ref.abs().max().item()
        print(f"probe_pv BN{BN} via_smem={via}: max rel err {err:.3e}", flush=True)
        # which V row does each P column meet? permuted-k diagnosis
        if err > 1e-3:
            for j in range(4):
                pe = torch.zeros(BM, BN, device="cuda"); pe[:, j] = 1.0
                probe_pv[(1,)](pe.to(torch.float8_e4m3fn), gs.descriptor(v_seq, [1, 1, D, BN]), O, BM, BN, via,
                               num_warps=4)
                rows = [(O[0].double() - v_seq[0, 0, :, c].double()).abs().max().item() for c in range(BN)]
                print(f"   P column {j} multiplies V key {min(range(BN), key=lambda c: rows[c])} "
                      f"(row0 err {min(rows):.2e}); O row0 head {O[0, :4].tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
