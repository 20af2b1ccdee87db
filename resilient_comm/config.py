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
