"""Developer tools for qattn_fx's kernels, run from the repository root as modules (``python -m tools.X --help``).

* :mod:`tools.profile_gluon`: launch gluon_sage at one shape and config, for Nsight Compute
  (``tools/device_session.sh ncu-gluon`` wraps it).
* :mod:`tools.ab_tail_split`: gluon_sage with and without the tail split, timed in one process.
* :mod:`tools.profile_quantize`: GPU time of every kernel of the compiled quantize + attention graph.
* :mod:`tools.gluon_probe`: the Gluon building blocks of gluon_sage (TMA, wgmma Q·Kᵀ and P·V) against torch.
* ``tools/device_session.sh``: the steps run on the lent GPU machine (tests, benchmarks, profiles).

They import ``qattn_fx`` (installed, or on ``PYTHONPATH``) and :mod:`benchmarks` (a package at the repository root).
"""
