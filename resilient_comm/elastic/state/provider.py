"""What a member's state is to the controller: the provider protocol, `TrainState` (model,
optimizer, RNG, extra state), the part of a state that every data-parallel replica holds
alike (`replicated_view`), and `Place` (where a process sits in the mesh). Runs in a worker
(`worker.controller`).

[Note: what the replicas compare] The replica comparison (`worker/integrity.py`) may only
read state that is equal on every dp replica of a healthy job. Parameters and optimizer state
are (every replica applies the same averaged gradients); RNG states seeded per rank, a data
loader's or sampler's position, per-rank counters and batch-norm statistics of local batches
are not. So the comparison reads a provider's ``replicated_state_dict()`` where it has one,
a module's parameters, and nothing of any other provider (the check is then off for it, and
says so once): a value that differs per rank and is compared anyway fails the job with its
keys named, since going back cannot make it equal."""

from __future__ import annotations

from collections.abc import Callable, Collection
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


_PARTS = ("model", "optimizer", "extra", "rng")


class TrainState:
    """A state provider bundling what a member needs to resume: model, optimizer, the RNG
    states of this process, and extra state (a data loader's position, counters...): any
    object with ``state_dict()``/``load_state_dict()``. Pass it as the controller's `state`.

    `replicated`: the parts every dp replica holds alike, which the replicas compare (the
    model's parameters, the optimizer's state; [Note: what the replicas compare]). Add
    ``"extra"`` where the extra state is the same on every rank (a global step counter), or
    ``"rng"`` where every rank seeds alike; leave them out where they differ per rank."""

    def __init__(
        self,
        model: Stateful,
        optimizer: Stateful | None = None,
        extra: Stateful | None = None,
        rng: bool = True,
        replicated: Collection[str] = ("model", "optimizer"),
    ) -> None:
        unknown = sorted(set(replicated) - set(_PARTS))
        if unknown or isinstance(replicated, str):
            raise ValueError(f"replicated names parts of {_PARTS}, got {replicated!r}")
        self.model, self.optimizer, self.extra, self.rng = model, optimizer, extra, rng
        self.replicated = tuple(p for p in _PARTS if p in replicated)

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.state_dict()
        if self.extra is not None:
            sd["extra"] = self.extra.state_dict()
        if self.rng:
            sd["rng"] = self._rng_state()
        return sd

    @staticmethod
    def _rng_state() -> dict[str, torch.Tensor]:
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    def replicated_state_dict(self) -> dict[str, Any]:
        """The `replicated` parts: the model's parameters (a module's buffers, such as batch-norm
        statistics of local batches, may differ per rank), the other parts' state dicts."""
        out: dict[str, Any] = {}
        if "model" in self.replicated:
            out["model"] = _parameters(self.model)
        if "optimizer" in self.replicated and self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        if "extra" in self.replicated and self.extra is not None:
            out["extra"] = self.extra.state_dict()
        if "rng" in self.replicated and self.rng:
            out["rng"] = self._rng_state()
        return out

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


def replicated_view(state: Stateful) -> dict[str, Any] | None:
    """What every dp replica holds alike of `state` ([Note: what the replicas compare]): its
    ``replicated_state_dict()``, a module's parameters, or None (nothing known to be)."""
    view = getattr(state, "replicated_state_dict", None)
    if callable(view):
        return view()
    if isinstance(state, torch.nn.Module):
        return _parameters(state)
    return None


def _parameters(model: Stateful) -> dict[str, Any]:
    if isinstance(model, torch.nn.Module):
        return dict(model.named_parameters())
    return model.state_dict()


__all__ = ["Place", "StateFactory", "Stateful", "TrainState", "replicated_view"]


def warm_up(warmup: Callable[[], Any] | None) -> None:
    """First-use costs paid before a state is needed (`Controller`'s `warmup`)."""
    import torch.optim  # noqa: F401  (a first import pulls in torch._dynamo: ~1 s of CPU)

    if warmup is not None:
        warmup()
