"""Quality you can measure: per-site errors of candidate recipes on the user's own calls, and a plan that keeps a
budget, written as a spec.

    result = qattn_fx.calibrate(model, calls, budget={"cos": 0.999}, emulate=True)
    print(result)                      # the table per site and candidate, the plan and why, end-to-end errors
    result.spec.to_json()              # the plan: backend(result.spec) deploys it
    result.plot("calibration.png")     # per-layer error per candidate

Modules: :mod:`.budget` (error metrics, :class:`Budget`), :mod:`.candidates` (what is tried), :mod:`.capture`
(intercepting sites as the backend identifies them), :mod:`.speed` (predicted speed), :mod:`.plan` (choices and
the spec), :mod:`.run` (:func:`calibrate`, :func:`measure`), :mod:`.result` (:class:`Calibration`), :mod:`.plot`;
:mod:`.skip` fits Skip-Softmax's thresholds to a ``target_sparsity`` (:func:`calibrate_skip_softmax`), :mod:`.block`
block sparsity's ``cdf`` / ``top_k`` (:func:`calibrate_block_sparse`).
"""

from .block import BlockCalibration, calibrate_block_sparse
from .budget import Budget, Errors, errors
from .candidates import DEFAULT_CANDIDATES, Candidate
from .result import Calibration, Table, TableRow, load
from .run import calibrate
from .skip import SkipCalibration, calibrate_skip_softmax
from .speed import NO_COST_DATA, SpeedSource, cost_data

__all__ = ["BlockCalibration", "Budget", "Calibration", "Candidate", "DEFAULT_CANDIDATES", "Errors", "NO_COST_DATA",
           "SkipCalibration", "SpeedSource", "Table", "TableRow", "calibrate", "calibrate_block_sparse",
           "calibrate_skip_softmax", "cost_data", "errors", "load"]
