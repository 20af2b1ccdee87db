"""The RESILIENT_COMM_* knobs: one table, declared in C++ (csrc/common/env.h) and read here."""

from __future__ import annotations

import os
from dataclasses import dataclass

from resilient_comm import _C


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    doc: str

    @property
    def value(self) -> str:
        """The value in effect: the environment's, or the default when unset or empty."""
        return os.environ.get(self.name) or self.default


def knobs() -> list[Knob]:
    """Every knob, in declaration order."""
    return [Knob(name, default, doc) for name, default, doc in _C.knobs()]


def knob(name: str) -> Knob:
    """The knob declared as `name`."""
    return next(k for k in knobs() if k.name == name)


def knob_int(name: str, least: int) -> int:
    """An integer knob's value, at least `least` (a clear ValueError otherwise)."""
    value = knob(name).value
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
    if n < least:
        raise ValueError(f"{name} must be at least {least}, got {value!r}")
    return n


def knob_s(name: str, least_ms: float) -> float:
    """A millisecond knob's value, in seconds; at least `least_ms` and positive (a clear
    ValueError otherwise)."""
    value = knob(name).value
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None
    if not ms >= least_ms or not ms > 0:
        raise ValueError(f"{name} must be at least {least_ms:g} ms and positive, got {value!r}")
    return ms / 1e3
