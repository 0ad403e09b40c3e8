"""Registered torch ops (namespace ``qattn``): quantize ops fused by Inductor, and opaque attention ops."""

from . import attention, predict, quantize  # noqa: F401  (importing registers the ops)
from .lowering import quantized_attention

__all__ = ["quantized_attention", "attention", "predict", "quantize"]
