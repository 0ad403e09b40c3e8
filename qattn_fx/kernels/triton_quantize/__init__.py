"""triton_quantize: the quantize ops of the Sage recipes as fused Triton passes, exact against their aten definitions.

The aten definitions in :mod:`qattn_fx.ops.quantize` (what graphs run unless ``qattn_fx.config.triton_quantize``
names an operand, and always on CPU) leave Inductor several passes per tensor: K's mean, block amax and cast read K
three times, V's amax and cast read V twice. These kernels make:

* Q (``quantize_per_block``, no smoothing): **one pass**: each program loads a tile of tokens × channels, takes the
  per-block amax in registers, writes the block scales and the 8-bit data;
* K (``smooth_k`` + ``quantize_per_block``): a **column pass** (per-channel fp32 partial sums over chunks of tokens,
  ``(B, H, NC, D)`` with ``NC`` ≤ 32) and the same one pass, whose programs first sum the partials to the mean and
  quantize ``k - mean`` in fp32: K read twice;
* V (``quantize_per_channel``, e4m3): a column pass (partial channel amax) and one pass that writes the e4m3 data,
  sequence-major (``(B, H, D, S16)``, zero-padded) or like ``x``.

Inputs are logical ``(B, H, S, D)`` bf16/fp16/fp32 with any strides (diffusers' BSHD views read in place); outputs
are those of :mod:`.layout`, the same as the aten ops'. Numerics: scales are ``amax · fp32(1/qmax)``
(:func:`qattn_fx.formats.amax_to_scale`), every other division is IEEE round-to-nearest as torch's ``/``, int8 rounds
half to even, e4m3 rounds to nearest even and saturates. So scales and data are bit-identical to
the aten definitions given the same mean; the mean itself is an fp32 sum whose order is implementation-defined (it
already differs between CPU, CUDA and Inductor), so K's data can differ from another implementation's by one unit
where ``(k - mean) / scale`` lies within an ulp of a rounding boundary.

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (the tests); the interpreter's e4m3 cast is not exact, so
there the kernel rounds onto the e4m3 grid in fp32 (exactly) and builds the e4m3 bits itself.

Importing the package imports no GPU library: :mod:`.launch` (which tries ``import triton``) loads on first use of
a name below.
"""

import importlib

__all__ = ["BLOCKS", "DTYPES", "MAX_HEAD_DIM", "column_pass", "quantize_per_block", "quantize_per_channel"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.launch"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
