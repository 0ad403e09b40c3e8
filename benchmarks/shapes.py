"""The benchmark shapes: one table for attention_ops, the tuner and the profiling tools.

Every shape is ``(B, H, Sq, Skv, D)`` with as many K/V heads as query heads, all bf16 inputs, head_dim 128 unless
stated. The presets are the attention calls of the models qattn_fx targets:

=============  ==========================  ==================================================================
name           B, H, Sq, Skv, D            what
=============  ==========================  ==================================================================
flux-1024      1, 24, 4608, 4608, 128      Flux joint attention at 1024x1024
wan1.3b-480p   1, 12, 32760, 32760, 128    Wan2.1-1.3B self-attention, 81 frames at 480p
wan14b-720p    1, 40, 75600, 75600, 128    Wan2.1-14B self-attention, 81 frames at 720p
cross-512      1, 40, 32760, 512, 128      Wan cross-attention to a 512-token text embedding
d64            2, 16, 16384, 16384, 64     a head_dim-64 DiT self-attention
=============  ==========================  ==================================================================

Command lines name presets (``--shapes wan1.3b-480p,flux-1024``; ``all``, ``none``) and add others with
``--shape name:B:H:Sq:Skv:D``.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple


class Shape(NamedTuple):
    b: int
    h: int
    sq: int
    skv: int
    d: int

    @property
    def flops(self) -> float:
        """``4·B·H·Sq·Skv·D``: Q·Kᵀ and P·V, the convention every TFLOP/s figure here uses."""
        return 4.0 * self.b * self.h * self.sq * self.skv * self.d

    def __str__(self) -> str:
        return f"B{self.b} H{self.h} Sq{self.sq} Skv{self.skv} D{self.d}"


SHAPES: dict[str, Shape] = {
    "flux-1024": Shape(1, 24, 4608, 4608, 128),
    "wan1.3b-480p": Shape(1, 12, 32760, 32760, 128),
    "wan14b-720p": Shape(1, 40, 75600, 75600, 128),
    "cross-512": Shape(1, 40, 32760, 512, 128),
    "d64": Shape(2, 16, 16384, 16384, 64),
}

#: The presets whose queries and keys are the same sequence (the tuner's default shapes).
SELF_ATTENTION: tuple[str, ...] = tuple(name for name, s in SHAPES.items() if s.sq == s.skv)


def parse_shape(spec: str) -> tuple[str, Shape]:
    """``name:B:H:Sq:Skv:D`` → ``(name, Shape)``."""
    parts = spec.split(":")
    if len(parts) != 6:
        raise ValueError(f"--shape {spec!r} is invalid; valid: name:B:H:Sq:Skv:D, e.g. mine:1:24:4608:4608:128")
    try:
        dims = tuple(int(p) for p in parts[1:])
    except ValueError:
        raise ValueError(f"--shape {spec!r}: B, H, Sq, Skv, D must be integers") from None
    if any(x <= 0 for x in dims):
        raise ValueError(f"--shape {spec!r}: every dimension must be >= 1")
    return parts[0], Shape(*dims)


def select(names: str, extra: Iterable[str] = (), *, default: Iterable[str] = tuple(SHAPES)) -> list[tuple[str, Shape]]:
    """Presets named in ``names`` (separated by ``,`` or ``;``; ``all``: every preset; ``none`` or empty: none),
    then the ``name:B:H:Sq:Skv:D`` specs of ``extra``. ``default`` is what ``all`` means."""
    chosen = []
    if names.strip() not in ("", "none"):
        wanted = list(default) if names.strip() == "all" else [
            n.strip() for n in names.replace(";", ",").split(",") if n.strip()]
        for name in wanted:
            if name not in SHAPES:
                raise ValueError(f"--shapes: {name!r} is unknown; valid: {', '.join(SHAPES)}, all, none")
            chosen.append((name, SHAPES[name]))
    chosen += [parse_shape(s) for s in extra]
    if not chosen:
        raise ValueError("no shape selected: use --shapes and/or --shape")
    return chosen
