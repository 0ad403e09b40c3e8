"""The block predictor: which blocks of a call to visit (:mod:`qattn_fx.block_sparse`), chosen from Q and K before
any Q·Kᵀ. :mod:`.reference` defines it in torch (any device); the op ``qattn::predict_blocks``
(:mod:`qattn_fx.ops.predict`) runs it."""

from .reference import MODES, predict

__all__ = ["MODES", "predict"]
