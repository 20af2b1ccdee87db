"""What a member's state is to the controller: the provider protocol, `TrainState` (model,
optimizer, RNG, extra state) and `Place` (where a process sits in the mesh). Runs in a
worker (`worker.controller`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Place:
    """Where this process sits in the current mesh. `slot` is the launch rank whose place it
    holds (itself, or for a hot spare the rank it replaced): use it for per-rank data streams."""

    rank: int
    slot: int
    coords: dict[str, int]


StateFactory = Callable[[Place], Stateful]


class TrainState:
    """A state provider bundling what a member needs to resume: model, optimizer, the RNG
    states of this process, and extra state (a data loader's position, counters...): any
    object with ``state_dict()``/``load_state_dict()``. Pass it as the controller's `state`."""

    def __init__(
        self,
        model: Stateful,
        optimizer: Stateful | None = None,
        extra: Stateful | None = None,
        rng: bool = True,
    ) -> None:
        self.model, self.optimizer, self.extra, self.rng = model, optimizer, extra, rng

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.state_dict()
        if self.extra is not None:
            sd["extra"] = self.extra.state_dict()
        if self.rng:
            sd["rng"] = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                sd["rng"]["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        if self.extra is not None:
            self.extra.load_state_dict(sd["extra"])
        if self.rng and "rng" in sd:
            torch.set_rng_state(sd["rng"]["torch"].clone())
            if "cuda" in sd["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state(sd["rng"]["cuda"].clone())


__all__ = ["Place", "StateFactory", "Stateful", "TrainState"]


def warm_up(warmup: Callable[[], Any] | None) -> None:
    """First-use costs paid before a state is needed (`Controller`'s `warmup`)."""
    import torch.optim  # noqa: F401  (a first import pulls in torch._dynamo: ~1 s of CPU)

    if warmup is not None:
        warmup()
