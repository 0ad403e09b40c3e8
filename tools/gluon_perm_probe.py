"""Offline check (no GPU): a token permutation inside each 32-key group makes P's wgmma accumulator layout the
register A-operand layout of the FP8 P·V wgmma, so P needs no cross-thread shuffles (gluon_sage.permk loads K
rows in that order).

    python tools/gluon_perm_probe.py   # "trivial compiled" = Gluon accepted convert_layout(..., assert_trivial=True)
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from qattn_fx.kernels import gluon_sage as gs

@gluon.jit
def probe(P, O, BN: gl.constexpr, TRIVIAL: gl.constexpr):
    s_layout: gl.constexpr = gs._mma_layout(4, BN, 8)
    o_layout: gl.constexpr = gs._mma_layout(4, 128, 8)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    offs_m = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    p = gl.load(P + offs_m[:, None] * BN + offs_n[None, :])
    p6 = gl.reshape(p, [64, BN // 32, 2, 2, 4, 2])
    p6 = gl.permute(p6, [0, 1, 2, 4, 3, 5])
    pp = gl.reshape(p6, [64, BN])
    po = gl.convert_layout(pp, p_layout, assert_trivial=TRIVIAL)
    gl.store(O + offs_m[:, None] * BN + offs_n[None, :], gl.convert_layout(po, s_layout).to(gl.float32))

sig={"P":"*fp8e4nv","O":"*fp32","BN":"constexpr","TRIVIAL":"constexpr"}
for triv in (False, True):
    try:
        c=triton.compile(GluonASTSource(fn=probe, signature=sig, constexprs={(2,):128,(3,):triv}, attrs={}), target=GPUTarget("cuda",90,32), options={"num_warps":4})
        ptx=c.asm["ptx"]
        print("trivial" if triv else "nontrivial", "compiled; shfl:", ptx.count("shfl.sync"), "prmt:", ptx.count("prmt"))
    except Exception as e:
        print("assert_trivial=%s failed:"%triv, str(e).splitlines()[-1][:300])
