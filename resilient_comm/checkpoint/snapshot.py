"""The host-copy plan of a checkpoint's state: the containers of the state are walked on the
caller's thread (:func:`plan_tree`), every tensor replaced by a slot into a flat list;
after the tensors are copied to host buffers, :func:`fill_tree` puts the buffers back in place.
Only values ``torch.load(weights_only=True)`` gives back unchanged are accepted.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

__all__ = ["fill_tree", "plan_tree"]

# Leaves torch.load(weights_only=True) gives back unchanged.
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.Size)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor of the state was: its index in the plan's list of tensors."""

    index: int


def plan_tree(obj: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """A copy of ``obj``'s containers with every tensor replaced by a slot into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
            raise TypeError(
                f"checkpoint: {where} is a {obj.layout} {obj.device.type} tensor; only dense tensors are saved"
            )
        tensors.append(obj.detach())
        return _Slot(len(tensors) - 1)
    if isinstance(obj, _LEAVES):
        return obj
    if type(obj) in (dict, collections.OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"checkpoint: {where} has a key of type {type(k).__name__}")
            out[k] = plan_tree(v, tensors, f"{where}[{k!r}]")
        return out
    if type(obj) in (list, tuple):
        return type(obj)(plan_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(
        f"checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; a state holds tensors, "
        "dicts, lists, tuples, None, bool, int, float, complex, str, bytes, torch.dtype and torch.Size"
    )


def fill_tree(plan: Any, buffers: list[torch.Tensor]) -> Any:
    """The state of ``plan`` with every slot replaced by its buffer of ``buffers``."""
    if isinstance(plan, _Slot):
        return buffers[plan.index]
    if isinstance(plan, dict):
        out = type(plan)()
        for k, v in plan.items():
            out[k] = fill_tree(v, buffers)
        return out
    if type(plan) in (list, tuple):
        return type(plan)(fill_tree(v, buffers) for v in plan)
    return plan
