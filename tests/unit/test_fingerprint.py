"""The replica comparison's pure parts: a fingerprint that any flipped bit changes, and the
verdict (who diverged) from the gathered fingerprints."""

from __future__ import annotations

import copy

import pytest
import torch

from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.state.fingerprint import fingerprint
from resilient_comm.elastic.worker.integrity import judge


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "count": torch.tensor(7)}


def test_equal_states_have_equal_fingerprints_and_a_copy_is_equal() -> None:
    a = _state()
    assert fingerprint(a) == fingerprint(copy.deepcopy(a)) == fingerprint(_state())
    assert len(fingerprint(a)) == 16


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int8, torch.bool])
def test_every_single_flipped_bit_changes_the_fingerprint(dtype: torch.dtype) -> None:
    t = (torch.arange(7) % 2).to(dtype) if dtype == torch.bool else torch.arange(7).to(dtype)
    base = fingerprint({"t": t})
    raw = t.view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = t.clone()
            flipped.view(torch.uint8)[byte] ^= 1 << bit
            assert fingerprint({"t": flipped}) != base, f"byte {byte} bit {bit}"


def test_swapped_words_a_renamed_key_a_shape_and_a_plain_value_change_it() -> None:
    t = torch.arange(6, dtype=torch.float64)
    base = fingerprint({"w": t})
    assert fingerprint({"w": t.flip(0)}) != base, "the same words in another order"
    assert fingerprint({"v": t}) != base
    assert fingerprint({"w": t.reshape(2, 3)}) != base
    s = _state()
    s2 = copy.deepcopy(s)
    s2["opt"]["param_groups"][0]["lr"] = 0.2
    assert fingerprint(s2) != fingerprint(s), "optimizer hyperparameters are state too"


def test_a_non_contiguous_and_an_empty_tensor_are_read_by_value() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fingerprint({"w": t.T}) == fingerprint({"w": t.T.contiguous()})
    assert fingerprint({"w": torch.empty(0)}) == fingerprint({"w": torch.empty(0)})


def test_the_majority_names_the_diverged_replica() -> None:
    ok, bad = b"a" * 16, b"b" * 16
    v = judge(39, [ok, bad, ok], [0, 1, 2], Mesh.for_world(3))
    assert not v.agreed and v.named == [1]
    assert judge(39, [ok, ok, ok], [0, 1, 2], Mesh.for_world(3)).agreed


def test_two_replicas_cannot_name_one() -> None:
    v = judge(9, [b"a" * 16, b"b" * 16], [4, 7], Mesh.for_world(2))
    assert not v.agreed and v.named == [] and list(v.diverged.values()) == [[]]


def test_tensor_parallel_shards_are_compared_only_with_their_own_place() -> None:
    # tp=2, dp=3: world ranks 0,1 are replica 0's two shards, 2,3 replica 1's, 4,5 replica 2's.
    mesh = Mesh.for_world(6, tp=2)
    shard0, shard1 = b"0" * 16, b"1" * 16
    assert judge(9, [shard0, shard1] * 3, list(range(6)), mesh).agreed, "shards differ by design"
    v = judge(9, [shard0, shard1, shard0, b"x" * 16, shard0, shard1], [10, 11, 12, 13, 14, 15], mesh)
    assert v.named == [13]


def test_a_flipped_bit_changes_only_its_leafs_fingerprint() -> None:
    from resilient_comm.elastic.state.fingerprint import leaf_fingerprints

    a = _state()
    b = copy.deepcopy(a)
    b["model"]["weight"].view(-1).view(torch.uint8)[3] ^= 0x04
    pa, pb = leaf_fingerprints(a), leaf_fingerprints(b)
    assert set(pa) == set(pb) and "/'model'/'weight'" in pa and "/'count'" in pa
    assert [k for k in pa if pa[k] != pb[k]] == ["/'model'/'weight'"]


def test_the_keys_that_differ_are_found_per_place_and_a_missing_key_differs() -> None:
    from resilient_comm.elastic.worker.integrity import differing_keys

    same = {"/'w'": "aa", "/'b'": "bb"}
    # tp=2, dp=2: world ranks 0 and 2 are one place's replicas, 1 and 3 the other's.
    other = {"/'w'": "xx"}  # the other tp shard: never compared with the first
    assert differing_keys([same, other, same, other], Mesh(tp=2, dp=2)) == []
    leaves = [same, same, {**same, "/'b'": "cc"}, {"/'w'": "aa"}]
    assert differing_keys(leaves, Mesh(tp=2, dp=2)) == ["/'b'"]
    assert differing_keys([same, {"/'w'": "aa"}], Mesh(dp=2)) == ["/'b'"], "a key one replica lacks"


def test_what_the_replicas_compare_leaves_out_per_rank_state() -> None:
    from resilient_comm.elastic.state.provider import TrainState, replicated_view

    class Position:
        def __init__(self) -> None:
            self.index = 0

        def state_dict(self) -> dict:
            return {"index": self.index}

        def load_state_dict(self, sd: dict) -> None:
            self.index = sd["index"]

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    st = TrainState(model, opt, extra=Position())
    view = replicated_view(st)
    assert view is not None and set(view) == {"model", "optimizer"}, "never RNG or a data position by default"
    assert set(view["model"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}, "parameters: no batch-norm statistics"
    assert set(replicated_view(TrainState(model, opt, Position(), replicated=("model", "extra", "rng")))) == {
        "model", "extra", "rng"}
    assert set(replicated_view(model)) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert replicated_view(Position()) is None, "a provider that says nothing: nothing is compared"
    with pytest.raises(ValueError, match="replicated names parts of"):
        TrainState(model, replicated=("model", "sampler"))
    with pytest.raises(ValueError, match="replicated names parts of"):
        TrainState(model, replicated="model")
