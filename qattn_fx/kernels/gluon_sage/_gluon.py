"""The Gluon imports of gluon_sage's kernel source (optional: the package imports without a Gluon-capable Triton, and
:func:`..launch.attention` then raises naming what is missing), the decorators that fall back to plain
functions without it, and the compile-time rules the kernel and both partitions share (the kernel's state:
:mod:`.state`)."""

from typing import Optional

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.core import _aggregate as aggregate

    GLUON_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only without a Gluon-capable triton
    triton = gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = async_copy = None
    fence_async_shared = None
    GLUON_ERROR = exc

    def aggregate(cls):
        return cls


def jit(fn):
    return gluon.jit(fn) if gluon is not None else fn


def constexpr_function(fn):
    return gluon.constexpr_function(fn) if gluon is not None else fn


@constexpr_function
def quantizes_q(q_dtype, k_dtype):
    """Q's descriptor is bf16/fp16 beside an 8-bit K (the host passes that form only with an int8 K,
    ``qattn_fx.kernels.q_quantized_in_kernel``): the consumers quantize Q themselves and the producer loads none."""
    return q_dtype.primitive_bitwidth != k_dtype.primitive_bitwidth


@constexpr_function
def mma_layout(num_warps, n, k_bits):
    """wgmma accumulator layout: ``num_warps`` warps along M, instruction ``m16 x n x (256 / bits)``."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 256 // k_bits])


@constexpr_function
def sum_layout(num_warps):
    """Accumulator layout of the ones-MMA (``mmasum``): ``(64, 8)`` fp32, every column the row sum of P."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8, 32])
