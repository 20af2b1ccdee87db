"""The replica comparison's policy, without processes: what follows each verdict (agree, go
back, evict, stop), driven by scripted verdicts in place of the gathered fingerprints."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.worker.errors import Evicted, ReplicaMismatchError
from resilient_comm.elastic.worker.integrity import GO_BACK_WINDOW, MAX_GO_BACKS, Integrity, Verdict


class Scripted(Integrity):
    """An Integrity whose comparisons return the next scripted verdict (None: agreed)."""

    def __init__(self, script: list[tuple[dict, list[str]] | None], **kw: Any) -> None:
        self.events: list[tuple[str, dict]] = []
        super().__init__(10, lambda ev, **info: self.events.append((ev, info)), **kw)
        self.script = script

    def compare(self, committed: int, view: Any, state: Any, world: Any, members: list[int], mesh: Mesh) -> Verdict:
        outcome = self.script.pop(0)
        if outcome is None:
            return Verdict(committed, True)
        diverged, keys = outcome
        v = Verdict(committed, False, diverged, back_to=committed - 10, keys=keys)
        self.named.update(v.named)
        return v


def _check(i: Integrity, step: int, rank: int = 0) -> int | None:
    return i.check(step, torch.nn.Linear(2, 2), None, [0, 1, 2], Mesh(dp=3), rank)  # type: ignore[arg-type]


def test_a_mismatch_that_comes_back_in_the_same_keys_stops_the_job_naming_them() -> None:
    rng = ({}, ["/'rng'/'torch'"])
    i = Scripted([rng, rng])
    assert _check(i, 99) == 89, "the first mismatch goes back: it may be corruption"
    with pytest.raises(ReplicaMismatchError, match=r"differs again after going back .* in the same keys: "
                                                    r"key\(s\) /'rng'/'torch'"):
        _check(i, 99)
    assert [e for e, _ in i.events] == ["integrity.mismatch", "integrity.mismatch"]
    assert i.events[0][1]["keys"] == ["/'rng'/'torch'"]


def test_a_healed_mismatch_is_forgotten_and_a_replica_named_twice_leaves() -> None:
    one = ({(0, 0): [1]}, ["/'w'"])
    i = Scripted([one, None, one])
    assert _check(i, 19, rank=1) == 9
    assert _check(i, 19, rank=1) is None, "the redone steps agree: it was corruption, healed"
    with pytest.raises(Evicted, match="diverged from its peers 2 times"):
        _check(i, 29, rank=1)


def test_going_back_more_than_the_bound_within_the_window_stops_the_job() -> None:
    script: list[Any] = []
    for k in range(MAX_GO_BACKS + 1):
        script += [({}, [f"/'w{k}'"]), None]  # each healed, each in other keys
    i = Scripted(script)
    with pytest.raises(ReplicaMismatchError, match=f"differed at {MAX_GO_BACKS + 1} of the last"):
        for step in range(2 * GO_BACK_WINDOW):
            _check(i, 10 * step + 9)


def test_a_sharded_state_or_one_with_nothing_replicated_turns_the_check_off_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", "resilient_comm.elastic")
    s = Scripted([], sharded=True)
    assert s.every == 0 and not s.due(99, last=True, checkpoint=True)
    assert "no two ranks hold the same shard" in s.events[0][1]["why"]

    class Opaque:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, sd: dict) -> None:
            pass

    i = Scripted([])
    assert i.due(9) and i.due(3, last=True) and i.due(4, checkpoint=True) and not i.due(4)
    assert i.check(9, Opaque(), None, [0, 1], Mesh(dp=2), 0) is None  # type: ignore[arg-type]
    assert i.check(19, Opaque(), None, [0, 1], Mesh(dp=2), 0) is None  # type: ignore[arg-type]
    assert i.every == 0 and [e for e, _ in i.events] == ["integrity.off"], "said once"
    assert caplog.text.count("the replicas' comparison is off") == 2
