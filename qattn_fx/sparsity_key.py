"""What the two sparsity spec keys share, :class:`~qattn_fx.recipes.SkipSoftmax` (``skip_softmax``) and
:class:`~qattn_fx.block_sparse_spec.BlockSparse` (``block_sparse``): exactly one of their controls, the optional
timestep gate ``disabled_until_timestep``, their names in tables and their dict form in a spec.

A leaf module (it imports only :mod:`qattn_fx.validate`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .validate import Checked, show


class SparsityKey(Checked):
    """Base of a frozen dataclass spec key with the fields named in ``CONTROLS`` and ``disabled_until_timestep``,
    subclassed as ``class SkipSoftmax(SparsityKey, key="skip_softmax", short="skip", controls=(...))``.

    ``KEY``: its name in a spec (also its ``WHERE``, the default ``where`` of the constructor and of
    :meth:`~qattn_fx.validate.Checked.from_dict`); ``SHORT``: its prefix in a table cell (:attr:`short_name`);
    ``CONTROLS``: the fields of which exactly one is set. A subclass defines ``_short_setting()``, what is set as the
    cell shows it.
    """

    CONTROLS: ClassVar[tuple[str, ...]] = ()
    KEY: ClassVar[str] = ""
    SHORT: ClassVar[str] = ""
    disabled_until_timestep: float | None

    def __init_subclass__(cls, *, key: str, short: str, controls: tuple[str, ...], **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.KEY, cls.SHORT, cls.CONTROLS = key, short, controls
        cls.WHERE = key

    def _check_one_control(self, where: str) -> None:
        """``ValueError`` unless exactly one of ``CONTROLS`` is set."""
        given = [name for name in self.CONTROLS if getattr(self, name) is not None]
        if len(given) != 1:
            got = ", ".join(f"{name}={show(getattr(self, name))}" for name in self.CONTROLS)
            raise ValueError(f"{where} needs exactly one of {' / '.join(self.CONTROLS)} (they are mutually "
                             f"exclusive); got {got}")

    @property
    def gated(self) -> bool:
        """Whether a timestep gate applies (``disabled_until_timestep`` > 0; 0 is vLLM-Omni's "off")."""
        return bool(self.disabled_until_timestep)

    def _gate(self) -> str:
        """``", dense while t > 0.9"`` with a gate (:meth:`describe`'s end), else ``""``."""
        return f", dense while t > {self.disabled_until_timestep:g}" if self.gated else ""

    def _short_setting(self) -> str:
        raise NotImplementedError

    @property
    def short_name(self) -> str:
        """The name in a table cell: ``SHORT`` and the setting (``skip 0.01``, ``bs cdf 0.9``); `` t<=0.9`` with a
        gate."""
        return f"{self.SHORT} {self._short_setting()}" + (f" t<={self.disabled_until_timestep:g}" if self.gated else "")

    def to_dict(self) -> dict:
        """Every field but the unset ones (the controls not chosen, no gate)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
