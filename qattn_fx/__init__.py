"""qattn_fx: quantized attention for diffusion transformers, as a torch.compile backend.

    model = torch.compile(model, backend=qattn_fx.backend(spec))

The public names: :func:`backend`, :func:`explain`, :func:`install_pre_grad_pass` (the compile pass),
:class:`Spec` / :class:`AttentionSpec` / :class:`Rule` / :class:`Match` (what to do where), :class:`Recipe`
(numerics), :class:`Site` / :class:`Decision` / :func:`resolve` (the policy), :class:`Hardware`, and
:func:`quantized_attention` (the eager op sequence), :func:`calibrate` / :class:`Budget` / :class:`Calibration`
(per-site errors on the user's calls and a plan that keeps a budget); Skip-Softmax: :class:`SkipSoftmax`,
:func:`calibrate_skip_softmax` (``target_sparsity`` → thresholds) and :mod:`qattn_fx.skip_softmax` (the contract,
measured sparsity); block sparsity: :class:`BlockSparse`, :func:`calibrate_block_sparse` (``target_sparsity`` →
``cdf`` / ``top_k`` per site) and :mod:`qattn_fx.block_sparse` (the tiles, measured sparsity); step schedules for quantization in general: :class:`DenseUntil`;
:func:`trace_multihead_attention` (``nn.MultiheadAttention``'s attention as a site).
"""

from .version import __version__  # noqa: E402

from . import config  # noqa: E402
from .backend import Backend, backend, install_pre_grad_pass, pre_grad_pass  # noqa: E402
from .calibration import (Budget, BlockCalibration, Calibration, SkipCalibration, calibrate, calibrate_block_sparse,
                          calibrate_skip_softmax)
from .explain import explain
from .fx.tracing import trace_multihead_attention
from .hardware import Hardware, detect
from .ops import quantized_attention
from .policy import Decision, Site, resolve
from .recipes import BlockSparse, Recipe, SkipSoftmax
from .report import Report
from .schedule import DenseUntil
from .spec import DENSE, AttentionSpec, Match, Rule, Spec

__all__ = [
    "AttentionSpec",
    "BlockCalibration",
    "Budget",
    "Calibration",
    "calibrate",
    "calibrate_block_sparse",
    "config",
    "Backend",
    "BlockSparse",
    "Report",
    "backend",
    "calibrate_skip_softmax",
    "explain",
    "install_pre_grad_pass",
    "pre_grad_pass",
    "DENSE",
    "Decision",
    "DenseUntil",
    "Hardware",
    "Match",
    "Recipe",
    "Rule",
    "Site",
    "SkipCalibration",
    "SkipSoftmax",
    "Spec",
    "detect",
    "quantized_attention",
    "resolve",
    "trace_multihead_attention",
]
