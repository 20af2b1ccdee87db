"""A fingerprint of a training state: 16 bytes that change when any bit of it changes.

Data-parallel replicas hold bit-identical state after every committed step; the controller
compares their fingerprints to find silent data corruption (`worker/integrity.py`). The
fingerprint reads the state's bits where they live (nothing is copied to the host; a large
contiguous tensor is read in place, tensors under 1 MB are concatenated first, since a pass
per small tensor costs more than the copy): the bytes, as int64 words (zero-padded to a whole
word), are summed twice, plainly and weighted by odd position weights, modulo 2**64. A single flipped bit changes the plain sum by +-2**k,
never 0 modulo 2**64; the weighted sum also sees words that swapped places. The sums of
every tensor, with its name, dtype and shape, and every non-tensor value (a learning rate, a
step count) go through BLAKE2b. Nothing here is a cryptographic guarantee against a chosen
collision: it guards against hardware, not against an adversary.

`leaf_fingerprints` gives one fingerprint per leaf instead (slower: a pass per tensor): what a
mismatch gathers to name the keys that differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_CHUNK = 1 << 20  # words weighted at a time: the weights are one cached tensor of this length
_BATCH_BYTES = 1 << 20  # tensors smaller than this are concatenated and summed together
_weights: dict[torch.device, torch.Tensor] = {}


def fingerprint(state: Any) -> bytes:
    """The fingerprint of `state` (a state dict: nested dicts, lists and tuples of tensors
    and plain values)."""
    h = hashlib.blake2b(digest_size=16)
    sums: list[torch.Tensor] = []
    batch: list[torch.Tensor] = []  # small tensors' bytes, summed as one (a pass per tensor costs more)
    batched = 0

    def flush() -> None:
        nonlocal batched
        if batch:
            sums.append(_sums(torch.cat(batch) if len(batch) > 1 else batch[0]))
            batch.clear()
            batched = 0

    for path, value in _leaves("", state):
        h.update(path.encode())
        if not isinstance(value, torch.Tensor):
            h.update(repr(value).encode())
            continue
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        raw = _bytes(value)
        if batch and batch[0].device != raw.device:
            flush()
        if raw.numel() >= _BATCH_BYTES:
            flush()
            sums.append(_sums(raw))
        else:
            batch.append(raw)
            batched += raw.numel()
            if batched >= _BATCH_BYTES:
                flush()
    flush()
    # One host copy per device for all the sums.
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for pair in sums:
        by_device.setdefault(pair.device, []).append(pair)
    for device in sorted(by_device, key=str):
        h.update(torch.stack(by_device[device]).cpu().numpy().tobytes())
    return h.digest()


def leaf_fingerprints(state: Any) -> dict[str, bytes]:
    """Every leaf's path in `state` (as `fingerprint` walks it: ``/'model'/'fc.weight'``) ->
    8 bytes that change when any bit of that leaf, its dtype or shape changes."""
    out = {}
    for path, value in _leaves("", state):
        h = hashlib.blake2b(digest_size=8)
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(_sums(_bytes(value)).cpu().numpy().tobytes())
        else:
            h.update(repr(value).encode())
        out[path] = h.digest()
    return out


def _leaves(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for k in sorted(value, key=repr):
            yield from _leaves(f"{path}/{k!r}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{path}[{i}]", v)
    else:
        yield path, value


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as a flat uint8 tensor (a view where `t` is contiguous). A DTensor is read
    as this rank's shard: its global view would be a collective."""
    raw = t.detach()
    to_local = getattr(raw, "to_local", None)  # a DTensor (duck-typed: no import of torch's tensor package)
    if to_local is not None:
        raw = to_local()
    if raw.is_complex():
        raw = torch.view_as_real(raw)
    raw = raw.contiguous().reshape(-1)
    return raw.view(torch.uint8) if raw.numel() else raw.new_empty(0, dtype=torch.uint8)


def _sums(b: torch.Tensor) -> torch.Tensor:
    """[plain sum, position-weighted sum] of the bytes `b` read as int64 words (zero-padded to
    a whole word), modulo 2**64, on `b`'s device."""
    if b.numel() % 8:
        b = torch.cat([b, b.new_zeros(8 - b.numel() % 8)])
    w = b.view(torch.int64)
    if w.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=b.device)
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


__all__ = ["fingerprint", "leaf_fingerprints"]
