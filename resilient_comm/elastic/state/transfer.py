"""Copy a member's training state to another over a process group, as tensors. Runs in a
worker: the donor and the receiver (`worker.commits`, on the recovery's world group).

A hot spare that takes a lost rank's place (and any member that must catch up) receives the
state of a *donor*: a member holding the same shard (same tp/pp coordinates, another
data-parallel replica). The state is whatever the registered state provider's
``state_dict()`` returns: nested dicts, lists and tuples of tensors and plain values (model,
optimizer, RNG state, data-loader position, ...).

**Nothing received is unpickled.** The donor sends three messages over the group:

1. an int64 tensor ``[header bytes, payload bytes]``;
2. the header: JSON (UTF-8, as a uint8 tensor) describing the tree: plain values inline,
   each tensor as its dtype, shape and byte offset in the payload;
3. the payload: every tensor's bytes, concatenated (one message, whatever the dtypes), each
   tensor padded to start at a multiple of its element size.

The receiver parses the JSON (plain data only: dicts, lists, numbers, strings), checks every
dtype against an allow-list and every offset against the payload's length, and rebuilds the
tree with tensors that are views of the received payload (a tensor that is not aligned, which
only a hand-made header gives, is copied out). Dict keys keep their type (an optimizer's
``state`` is keyed by int). Tensors are sent from their current device through host memory
(``.cpu()``) and arrive on the CPU; ``load_state_dict`` copies them into place.

A state nests at most ``kMaxDepth`` containers deep, on both sides. Whatever arrives, anything
malformed (not JSON, nested too deep, a wrong type anywhere, bytes that do not fit) is a
:class:`StateSyncError`, the parser's error as its cause where there is one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeGuard

import torch
import torch.distributed as dist

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
_LEAVES = (str, int, float, bool, type(None))
# Containers a state may nest (a model's and an optimizer's state_dict nest 2-4): deep enough for
# any state, shallow enough that neither side can run out of Python stack.
kMaxDepth = 64


class StateSyncError(RuntimeError):
    """A state could not be sent or what arrived is not a valid state."""


def pack(state: Any) -> tuple[bytes, torch.Tensor]:
    """(header JSON, payload as uint8) of a state tree."""
    chunks: list[torch.Tensor] = []
    offset = 0

    def walk(obj: Any, depth: int) -> Any:
        nonlocal offset
        if depth > kMaxDepth:
            raise StateSyncError(
                f"cannot send a state nested more than {kMaxDepth} containers deep "
                "(a container that holds itself?)"
            )
        if isinstance(obj, torch.Tensor):
            name = str(obj.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise StateSyncError(f"cannot send a tensor of dtype {obj.dtype}")
            t = obj.detach().cpu().contiguous()
            pad = -offset % t.element_size()  # the receiver views the payload in place
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            node = {"t": name, "shape": list(t.shape), "at": offset, "n": raw.numel()}
            chunks.append(raw)
            offset += raw.numel()
            return node
        if isinstance(obj, dict):
            return {"d": [[walk(k, depth + 1), walk(v, depth + 1)] for k, v in obj.items()]}
        if isinstance(obj, list):
            return {"l": [walk(v, depth + 1) for v in obj]}
        if isinstance(obj, tuple):
            return {"u": [walk(v, depth + 1) for v in obj]}
        if isinstance(obj, _LEAVES):
            return {"v": obj}
        raise StateSyncError(
            f"cannot send a {type(obj).__name__} in a state: only tensors, dicts, lists, "
            f"tuples, str, int, float, bool and None"
        )

    tree = walk(state, 0)
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return json.dumps(tree, separators=(",", ":")).encode(), payload


def unpack(header: bytes, payload: torch.Tensor) -> Any:
    """The state tree of `pack`'s output; raises StateSyncError on anything malformed."""
    try:
        tree = json.loads(header.decode())
    except ValueError as e:  # not UTF-8, not JSON, or an integer longer than Python converts
        raise StateSyncError(f"state header is not valid JSON: {e}") from e
    except RecursionError as e:
        raise StateSyncError("state header nests deeper than the JSON parser goes") from e
    size = payload.numel()

    def tensor(node: dict[str, Any]) -> torch.Tensor:
        name, shape, at, n = node["t"], node.get("shape"), node.get("at"), node.get("n")
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None or not isinstance(shape, list) or not _is_int(at) or not _is_int(n):
            raise StateSyncError(f"malformed tensor node {str(node)[:80]!r}")
        numel, extent = 1, dtype.itemsize
        for s in shape:
            if not _is_int(s) or s < 0:
                raise StateSyncError(f"bad tensor shape {str(shape)[:80]}")
            numel *= s
            extent *= max(s, 1)  # torch sizes a tensor's strides in int64, even with no elements
            if extent >= 1 << 63:
                raise StateSyncError(f"tensor shape {str(shape)[:80]} overflows 64-bit strides")
        if n != numel * dtype.itemsize or at < 0 or at + n > size:
            raise StateSyncError(
                f"tensor bytes [{at}, {at + n}) do not fit shape {shape} of {dtype} "
                f"in a payload of {size} bytes"
            )
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        raw = payload[at : at + n]
        if raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()  # torch views bytes as a wider dtype only at an aligned offset
        return raw.view(dtype).reshape(shape)

    def children(node: dict[str, Any], kind: str) -> list[Any]:
        items = node[kind]
        if not isinstance(items, list):
            raise StateSyncError(f"malformed state node {str(node)[:80]!r}: {kind!r} holds no list")
        return items

    def build(node: Any, depth: int) -> Any:
        if depth > kMaxDepth:
            raise StateSyncError(f"state nests more than {kMaxDepth} containers deep")
        if not isinstance(node, dict) or len(node) not in (1, 4):
            raise StateSyncError(f"malformed state node {str(node)[:80]!r}")
        if "t" in node:
            return tensor(node)
        if "d" in node:
            out = {}
            for pair in children(node, "d"):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise StateSyncError("malformed dict entry")
                key = build(pair[0], depth + 1)
                if not isinstance(key, (str, int, float, bool, type(None))):
                    raise StateSyncError(f"dict key of type {type(key).__name__}")
                out[key] = build(pair[1], depth + 1)
            return out
        if "l" in node:
            return [build(v, depth + 1) for v in children(node, "l")]
        if "u" in node:
            return tuple(build(v, depth + 1) for v in children(node, "u"))
        if "v" in node:
            if not isinstance(node["v"], _LEAVES):
                raise StateSyncError(f"malformed value {str(node['v'])[:80]!r}")
            return node["v"]
        raise StateSyncError(f"malformed state node {str(node)[:80]!r}")

    return build(tree, 0)


def _is_int(x: object) -> TypeGuard[int]:
    """An int that is not a bool (JSON's true would pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def send_state(state: Any, dst: int, group: dist.ProcessGroup) -> int:
    """Send `state` to group rank `dst` (which calls `recv_state`); returns the bytes sent."""
    header, payload = pack(state)
    sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64)
    dist.send(sizes, group=group, group_dst=dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), group=group, group_dst=dst)
    if payload.numel():
        dist.send(payload, group=group, group_dst=dst)
    return len(header) + payload.numel()


def recv_state(src: int, group: dist.ProcessGroup, max_bytes: int = 1 << 40) -> Any:
    """Receive a state sent by group rank `src` with `send_state`."""
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, group=group, group_src=src)
    nheader, npayload = (int(x) for x in sizes)
    if not 0 < nheader <= 1 << 30 or not 0 <= npayload <= max_bytes:
        raise StateSyncError(f"rank {src} announced a state of {nheader} header and {npayload} payload bytes")
    header = torch.empty(nheader, dtype=torch.uint8)
    dist.recv(header, group=group, group_src=src)
    payload = torch.empty(npayload, dtype=torch.uint8)
    if npayload:
        dist.recv(payload, group=group, group_src=src)
    return unpack(header.numpy().tobytes(), payload)


def digest(state: Any) -> str:
    """A short hash of a state tree, bit-exact (tensor bytes, dtypes, shapes, structure)."""
    header, payload = pack(state)
    h = hashlib.sha256(header)
    h.update(payload.numpy().tobytes() if payload.numel() else b"")
    return h.hexdigest()[:16]


__all__ = ["StateSyncError", "digest", "kMaxDepth", "pack", "recv_state", "send_state", "unpack"]
