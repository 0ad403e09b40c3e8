"""The argument checks shared by the spec, the recipes, the policy, the backend and the calibration: one leaf module
(it imports nothing of qattn_fx), so each of them checks its values the same way without reaching into another.

Every ``check_*`` takes the path of the value (``spec.rules[0].match.head_dim``, or an argument's name) and raises
``ValueError`` naming that path, the bad value and what is valid (:func:`invalid`); it returns the value on success.
:func:`wrong_type` is the ``TypeError`` of an entry point's argument of the wrong Python type, naming what is
accepted. :func:`path_at` builds a path, :func:`show` a value's shortened ``repr``. :class:`Checked` is the base of
the spec's dataclasses, which run these checks when built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, InitVar, dataclass
from typing import Any, Callable, ClassVar, Iterable


def check_range(name: str, value: float | None, lo: float, hi: float) -> None:
    """A finite number (int or float, not a bool) in ``[lo, hi]`` (``hi`` may be ``inf``), or ``None``; an int
    must also convert to a float."""
    if value is None:
        return
    bound = f"[{lo}, {hi}]" if math.isfinite(hi) else f">= {lo}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise invalid(name, value, f"a finite number, {bound}")
    if not lo <= value <= hi:  # ints compare exactly, whatever their size
        raise ValueError(f"{name}={show(value)} is out of range; valid: finite, {bound}")
    if not finite_float(value):  # in range but beyond float's (10**400): checked here, not where a kernel reads it
        raise invalid(name, value, f"a finite number, {bound}")


def finite_float(value: int | float) -> bool:
    """Whether ``value`` is a finite float or an int that converts to one (an int beyond float's range, 10**400,
    raises ``OverflowError`` where a kernel or a division reads it as a float)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def path_at(where: str, name: str) -> str:
    """The path of ``name`` inside ``where`` (``where`` empty: the bare name)."""
    return f"{where}.{name}" if where else name


def show(value: object, limit: int = 120) -> str:
    """``repr(value)``, shortened to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def invalid(path: str, value: object, valid: str) -> ValueError:
    return ValueError(f"{path}={show(value)} is invalid; valid: {valid}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> Any:
    if not isinstance(value, str) or value not in choices:
        raise invalid(name, value, fmt_set(choices))
    return value


def check_int(path: str, value: Any, minimum: int) -> int:
    """An int (not a bool, not a float) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(path, value, f"an int >= {minimum}")
    return value


def check_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(path, value, "true, false")
    return value


def check_str(path: str, value: Any, valid: str) -> str:
    if not isinstance(value, str):
        raise invalid(path, value, valid)
    return value


def check_mapping(where: str, data: Any, what: str = "a mapping") -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be {what}, got {type(data).__name__}: {show(data)}")
    return data


def check_list(where: str, data: Any) -> list | tuple:
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"{where} must be a list, got {type(data).__name__}: {show(data)}")
    return data


def check_items(path: str, value: Any, check_item: Callable[[str, Any], Any], valid: str) -> tuple:
    """One item or a non-empty list of items, each passed through ``check_item(item_path, item)``; a tuple."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise invalid(path, value, f"{valid}, or a non-empty list of them")
        return tuple(check_item(f"{path}[{i}]", item) for i, item in enumerate(value))
    return (check_item(path, value),)


def reject_unknown(data: Any, known: set[str], where: str) -> None:
    check_mapping(where, data)
    unknown = sorted(set(data) - known, key=str)  # YAML keys need not be strings
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid: {sorted(known)}")


def from_fields(cls: type, data: Any, where: str) -> Any:
    """The dataclass ``cls`` from a mapping of its fields (an unknown key is an error naming ``where``), built with
    ``where`` (the keyword-only path its checks report)."""
    reject_unknown(data, {f.name for f in dataclasses.fields(cls)}, where)
    return cls(**data, where=where)


@dataclass(frozen=True)
class Checked:
    """Base of a frozen dataclass of a spec (a recipe, a sparsity key, an attention spec, a match, a rule) that checks
    its fields when built. It takes a keyword-only ``where`` (an ``InitVar``, not a field): its place in a spec
    (``spec.rules[0].use``), under which error messages name each bad field; not given, the class's ``WHERE``. A
    subclass checks (and normalizes, ``object.__setattr__``) its fields in ``_check(where)``.
    """

    #: The ``where`` of an instance built without one, and of :meth:`from_dict` (empty: bare field names).
    WHERE: ClassVar[str] = ""
    _: KW_ONLY
    where: InitVar[str | None] = None

    def __post_init__(self, where: str | None) -> None:
        self._check(self.WHERE if where is None else where)

    def _check(self, where: str) -> None:
        """Raise ``ValueError`` naming the bad field under ``where`` (:func:`path_at`)."""

    @classmethod
    def from_dict(cls, data: Any, *, where: str | None = None):
        """The dataclass from a mapping of its fields (an unknown key is an error naming ``where``, default
        ``WHERE``)."""
        return from_fields(cls, data, cls.WHERE if where is None else where)


def unique(items: Iterable) -> tuple:
    return tuple(dict.fromkeys(items))


def fmt_tuple(t: tuple[int, ...]) -> str:
    return "(" + ",".join(str(x) for x in t) + ")"


def fmt_set(items: Iterable) -> str:
    return ", ".join(str(x) for x in items)


def wrong_type(name: str, value: Any, accepted: str) -> TypeError:
    """The ``TypeError`` for an argument ``name`` of the wrong Python type: ``emulate must be True or False; got
    str: 'yes'``."""
    return TypeError(f"{name} must be {accepted}; got {type(value).__name__}: {show(value, 80)}")


__all__ = ["Checked", "path_at", "show", "invalid", "wrong_type", "check_choice", "check_int", "check_bool",
           "check_str", "check_mapping", "check_list", "check_items", "check_range", "finite_float", "reject_unknown",
           "from_fields", "unique", "fmt_tuple", "fmt_set"]
