"""Loading triton_sage's Triton source files (:mod:`.tiles`, :mod:`.walk`, :mod:`.kernel`), once per Triton mode.

Each file is loaded as a module of its own with ``@triton.jit`` in the mode asked for
(:func:`~qattn_fx.kernels._cuda_utils.load_triton_source`), never imported as the package's module, so the
interpreter tests can turn ``TRITON_INTERPRET`` on after the package was imported while an offline compile still
gets compiled functions. A source file takes another's functions with :func:`sibling`, which loads that file in the
mode of the one being loaded: compiled kernels call compiled helpers, interpreted kernels interpreted ones.
"""

from __future__ import annotations

from pathlib import Path

from .._cuda_utils import load_triton_source, triton_interpreting

#: file stem → its modules, keyed by ``interpret``.
_MODULES: dict[str, dict[bool, object]] = {}


def load(stem: str, interpret: bool):
    """Source file ``<stem>.py`` of this package loaded in interpreter (``interpret``) or compiled mode, once each
    (as module ``qattn_fx.kernels.triton_sage._<stem>_<interpreted|compiled>``). Needs triton."""
    return load_triton_source(__package__, Path(__file__).with_name(f"{stem}.py"), f"_{stem}", interpret,
                              _MODULES.setdefault(stem, {}))


def sibling(stem: str):
    """Source file ``<stem>.py`` loaded in the Triton mode in effect now: called at the top of a source file being
    loaded, the mode that file is loaded in."""
    return load(stem, triton_interpreting())
