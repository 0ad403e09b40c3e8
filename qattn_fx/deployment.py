"""What a site would run, without emulation, on the hardware its recipe is meant for (:func:`deployment`): an
emulated site's ``Decision.deployment``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .cost_rule import cost_rule, is_auto
from .hardware import Hardware
from .serving import candidates, first_serving, why_not
from .site import Deployment, DeploymentClause, Site
from .spec import AttentionSpec


Target = Hardware | str | Sequence[Hardware | str] | None


def deployment_targets(use: AttentionSpec) -> tuple[str, ...]:
    """The architectures a recipe of ``use`` is meant for: one per implementation of the rows of ``use.backend``
    that accept the recipe, skipping an implementation whose archs an earlier one already covers (TRTLLM →
    ``sm_100``; TRITON → ``sm_90``; CUDNN fp8 → ``sm_100``, ``sm_90``; ``auto`` int8 → ``sm_90``, ``sm_100``)."""
    archs: list[str] = []
    for _, req in candidates(use):
        if req.archs is None or any(a in archs for a in req.archs):
            continue
        archs.append(req.archs[0])
    return tuple(archs)


def _target_hardware(target: Target, use: AttentionSpec) -> tuple[Hardware, ...]:
    if target is None:
        target = deployment_targets(use)
    if isinstance(target, (Hardware, str)):
        target = (target,)
    return tuple(t if isinstance(t, Hardware) else Hardware.supported_install(t) for t in target)


def deployment(site: Site, use: AttentionSpec, target: Target = None) -> Deployment:
    """What ``site`` would run, without emulation, on each deployment target: ``target`` (a :class:`Hardware`, an
    arch such as ``"sm_90"`` for a supported install of it, or a sequence of them) or, by default, the archs the
    recipe's backend is meant for (:func:`deployment_targets`, each with a supported install).

    One clause per target: ``on sm_90: gluon_sage``, ``on sm_100: dense (TRTLLM: head_dim 12 not in 128)`` for
    ``auto``, ``on sm_100: error (...)`` for an explicit backend (which raises where it cannot run). A float32
    site (a CPU model) is judged as bf16, as GPUs run it, and the text starts with ``(as bf16)``.
    """
    if use.recipe is None:
        return Deployment(note="no kernel in qattn_fx runs bf16 + skip-softmax (trtllm-gen's dense FMHA, sm_100, "
                               "is not wired)")
    as_bf16 = site.dtype == torch.float32
    if as_bf16:
        site = dataclasses.replace(site, dtype=torch.bfloat16,
                                   kv_dtypes=None if site.kv_dtypes is None else (torch.bfloat16,) * 2)
    rows = candidates(use)
    clauses = []
    for hardware in _target_hardware(target, use):
        here = tuple((row, req) for row, req in rows if req.archs is not None and hardware.arch in req.archs)
        found, reasons = first_serving(here, site, hardware, use)
        if found is not None:
            kernel = found[1].kernel
            dense, said = cost_rule(kernel, site, hardware, use.block_sparse) if is_auto(use) else (False, None)
            clauses.append(DeploymentClause(hardware.arch, "dense" if dense else "kernel", None if dense else kernel,
                                            said or ""))
            continue
        why = why_not(reasons, grouped=True) or f"no {use.backend} kernel for {hardware.arch}"
        clauses.append(DeploymentClause(hardware.arch, "dense" if is_auto(use) else "error", detail=why))
    return Deployment(tuple(clauses), as_bf16)
