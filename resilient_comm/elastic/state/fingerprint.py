"""A fingerprint of a training state: 16 bytes that change when any bit of it changes.

Data-parallel replicas hold bit-identical state after every committed step; the controller
compares their fingerprints to find silent data corruption (`worker/integrity.py`). The
fingerprint reads a tensor's bits where it lives (no copy to the host, no copy at all for a
contiguous tensor): its words, as int64, are summed twice, plainly and weighted by odd
position weights, both modulo 2**64. A single flipped bit changes the plain sum by +-2**k,
never 0 modulo 2**64; the weighted sum also sees words that swapped places. The sums of
every tensor, with its name, dtype and shape, and every non-tensor value (a learning rate, a
step count) go through BLAKE2b. Nothing here is a cryptographic guarantee against a chosen
collision: it guards against hardware, not against an adversary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_CHUNK = 1 << 20  # words weighted at a time: the weights are one cached tensor of this length
_weights: dict[torch.device, torch.Tensor] = {}


def fingerprint(state: Any) -> bytes:
    """The fingerprint of `state` (a state dict: nested dicts, lists and tuples of tensors
    and plain values)."""
    h = hashlib.blake2b(digest_size=16)
    sums: list[torch.Tensor] = []
    for path, value in _leaves("", state):
        h.update(path.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            sums.append(_sums(value))
        else:
            h.update(repr(value).encode())
    if sums:
        # One host copy for all of them (a device state's sums are gathered on the device).
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(sums):
            by_device.setdefault(s.device, []).append(i)
        host: list[torch.Tensor | None] = [None] * len(sums)
        for idx in by_device.values():
            stacked = torch.stack([sums[i] for i in idx]).cpu()
            for j, i in enumerate(idx):
                host[i] = stacked[j]
        for pair in host:
            assert pair is not None
            h.update(pair.numpy().tobytes())
    return h.digest()


def _leaves(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k in sorted(value, key=repr):
            yield from _leaves(f"{path}/{k!r}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{path}[{i}]", v)
    else:
        yield path, value


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as a flat int64 tensor (one word per 8, 4, 2 or 1 bytes, whichever divides)."""
    raw = t.detach().contiguous().reshape(-1)
    if raw.is_complex():
        raw = torch.view_as_real(raw).reshape(-1)
    b = raw.view(torch.uint8) if raw.numel() else raw.new_empty(0, dtype=torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b.numel() % size == 0:
            return b.view(dtype).to(torch.int64)
    return b.to(torch.int64)


def _sums(t: torch.Tensor) -> torch.Tensor:
    """[plain sum, position-weighted sum] of `t`'s words, modulo 2**64, on `t`'s device."""
    w = _words(t)
    if w.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    weights = _weights.get(w.device)
    if weights is None:
        weights = _weights[w.device] = torch.arange(1, 2 * _CHUNK, 2, dtype=torch.int64, device=w.device)
    plain = w.sum()
    weighted = torch.zeros((), dtype=torch.int64, device=w.device)
    for j, start in enumerate(range(0, w.numel(), _CHUNK)):
        chunk = w[start : start + _CHUNK]
        # Odd chunk salt times odd weights: every word's weight is odd, so a flipped bit counts.
        weighted += (chunk * weights[: chunk.numel()]).sum() * (2 * j + 1)
    return torch.stack([plain, weighted])


__all__ = ["fingerprint"]
