"""resilient_comm.checkpoint: round trip, pruning, kill mid-flush, truncation, corruption, advisor."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import zipfile
from typing import Any

import pytest
import torch

from resilient_comm.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    IntervalAdvisor,
    latest_complete,
    manifest_file,
    rank_file,
    verify,
)
from resilient_comm.checkpoint.interval import daly_interval, expected_waste, job_mtbf_s

pytestmark = pytest.mark.timeout(60)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    nan_payload = torch.tensor([0x7FC0_1234], dtype=torch.int32).view(torch.float32)  # a NaN with payload bits
    return {
        "model": {
            "w": torch.randn(8, 5, generator=g),
            "w_t": torch.randn(5, 8, generator=g).t(),  # not contiguous
            "half": torch.randn(7, generator=g).half(),
            "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
            "f64": torch.randn(2, generator=g, dtype=torch.float64),
            "nan": nan_payload,
            "i8": torch.randint(-128, 127, (6,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (6,), generator=g, dtype=torch.uint8),
            "i64": torch.randint(0, 1 << 40, (3,), generator=g),
            "mask": torch.rand(4, generator=g) > 0.5,
            "cplx": torch.randn(2, generator=g, dtype=torch.complex64),
            "scalar": torch.tensor(seed * 1.5),
            "empty": torch.empty(0, 3),
        },
        "optim": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(4, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "amsgrad": False}]},
        "rng": {"cpu": torch.get_rng_state(), "gen": g.get_state()},
        "data": {"epoch": seed, "offset": 1 << 40, "path": "shard-3", "resume": None, "frac": 0.25, "blob": b"\x00\x01"},
        "meta": [seed, ("a", torch.float16, torch.Size([2, 3]))],
    }


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _save(ckpt: AsyncCheckpointer, step: int, state: dict[str, Any]) -> None:
    assert ckpt.save(step, state)
    ckpt.wait_snapshot()
    ckpt.wait()


def test_round_trip_is_bit_exact_and_the_snapshot_is_a_copy(tmp_path: pathlib.Path) -> None:
    state = _state(1)
    expected = _state(1)
    with AsyncCheckpointer(tmp_path, rank=3) as ckpt:
        assert ckpt.save(7, state)
        ckpt.wait_snapshot()
        # The contract: after wait_snapshot() the caller may update the tensors and the containers.
        for t in state["model"].values():
            t.zero_() if t.dtype != torch.bool else t.logical_not_()
        state["data"]["epoch"] = 99
        ckpt.wait()
        assert ckpt.latest() == 7
        step, loaded = ckpt.load()
    assert step == 7
    _assert_same(expected, loaded)
    assert os.path.exists(rank_file(tmp_path, 7, 3))
    m = json.loads(pathlib.Path(manifest_file(tmp_path, 7, 3)).read_text())
    assert (m["step"], m["rank"], m["bytes"]) == (7, 3, os.path.getsize(rank_file(tmp_path, 7, 3)))


def test_host_buffers_are_reused_between_saves(tmp_path: pathlib.Path) -> None:
    with AsyncCheckpointer(tmp_path, rank=0) as ckpt:
        _save(ckpt, 1, _state(1))
        ptrs = [b.data_ptr() for b in ckpt._buffers]
        _save(ckpt, 2, _state(2))
        assert [b.data_ptr() for b in ckpt._buffers] == ptrs
        _, loaded = ckpt.load()
    _assert_same(_state(2), loaded)


def test_keep_n_prunes_old_steps_and_latest_complete_spans_ranks(tmp_path: pathlib.Path) -> None:
    r0, r1 = AsyncCheckpointer(tmp_path, 0, keep=2), AsyncCheckpointer(tmp_path, 1, keep=2)
    for step in (10, 20, 30):
        _save(r0, step, {"x": torch.full((3,), step)})
    _save(r1, 10, {"x": torch.zeros(1)})
    _save(r1, 20, {"x": torch.zeros(1)})
    # rank 0 keeps 20 and 30; its step-10 file is gone but rank 1's keeps the directory.
    assert not os.path.exists(rank_file(tmp_path, 10, 0)) and os.path.exists(rank_file(tmp_path, 10, 1))
    assert (r0.latest(), r1.latest()) == (30, 20)
    assert latest_complete(tmp_path, 1) == 30
    assert latest_complete(tmp_path, 2) == 20
    assert latest_complete(tmp_path, 3) is None
    _save(r1, 30, {"x": torch.zeros(1)})
    assert latest_complete(tmp_path, 2) == 30
    assert sorted(os.listdir(tmp_path)) == ["step-00000020", "step-00000030"]  # step 10 emptied and removed
    r0.close()
    r1.close()
    assert latest_complete(tmp_path / "nothing", 1) is None


_KILLED_CHILD = textwrap.dedent(
    """
    import sys, torch
    from resilient_comm.checkpoint import AsyncCheckpointer
    ckpt = AsyncCheckpointer(sys.argv[1], rank=2)
    ckpt.save(1, {"x": torch.arange(1000.0)}); ckpt.wait()
    def hook(event, info):
        if event == "write" and info["bytes"] > 4096:
            print(info["path"], flush=True)   # the tmp file is partly written: tell the parent
            sys.stdin.read()                  # and hang until SIGKILLed
    ckpt._test_hook = hook
    ckpt.save(2, {"x": torch.zeros(100000)}); ckpt.wait()
    print("not killed", flush=True)
    """
)


def test_sigkill_mid_flush_keeps_the_previous_checkpoint(tmp_path: pathlib.Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tmp = child.stdout.readline().strip()  # type: ignore[union-attr]
        assert tmp, f"the child exited before the flush: {child.communicate()[1]}"
        assert os.path.getsize(tmp) > 4096 and os.path.dirname(tmp).endswith("step-00000002")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert not os.path.exists(manifest_file(tmp_path, 2, 2))
    ckpt = AsyncCheckpointer(tmp_path, rank=2)  # a spare taking rank 2's place
    assert not os.path.exists(tmp), "the dead writer's tmp file was not removed"
    assert ckpt.latest() == 1 and latest_complete(tmp_path, 3) is None
    step, state = ckpt.load()
    assert step == 1 and torch.equal(state["x"], torch.arange(1000.0))
    _save(ckpt, 2, {"x": torch.ones(5)})
    assert ckpt.load()[0] == 2
    ckpt.close()


def _saved_twice(tmp_path: pathlib.Path, n: int) -> AsyncCheckpointer:
    """Rank 0's checkpoints of steps 1 and 2 ({"x": arange(n)}, then twice that)."""
    ckpt = AsyncCheckpointer(tmp_path, rank=0, keep=5)
    _save(ckpt, 1, {"x": torch.arange(float(n))})
    _save(ckpt, 2, {"x": torch.arange(float(n)) * 2})
    return ckpt


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_checkpoint_is_named_and_skipped(tmp_path: pathlib.Path, damage: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    ckpt = _saved_twice(tmp_path, 100)
    path = rank_file(tmp_path, 2, 0)
    data = bytearray(pathlib.Path(path).read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="resilient_comm.checkpoint"):
        step, state = ckpt.load()
    assert step == 1 and torch.equal(state["x"], torch.arange(100.0))
    reason = "truncated" if damage == "truncate" else "corrupted"
    assert any(path in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text
    assert ckpt.latest() == 1 and latest_complete(tmp_path, 1) == 1
    with pytest.raises(CheckpointError, match=re.escape(f"step 2: {path} is {reason}")):
        ckpt.load(2)
    ckpt.close()


def test_no_valid_checkpoint_raises(tmp_path: pathlib.Path) -> None:
    ckpt = AsyncCheckpointer(tmp_path, rank=1)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        ckpt.load()
    _save(ckpt, 5, {"x": torch.ones(10)})
    pathlib.Path(rank_file(tmp_path, 5, 1)).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"no valid checkpoint(.|\n)*rank-00001.pt is truncated"):
        ckpt.load()
    assert ckpt.latest() is None
    ckpt.close()


@pytest.mark.parametrize("damage", ["deep", "infinite"])
def test_a_malformed_manifest_is_a_reason_never_an_exception(tmp_path: pathlib.Path, damage: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    ckpt = _saved_twice(tmp_path, 10)
    mpath = pathlib.Path(manifest_file(tmp_path, 2, 0))
    if damage == "deep":  # json.load recurses: RecursionError
        mpath.write_text("[" * 100_000 + "]" * 100_000)
        reason = "nested deeper than the JSON parser goes"
    else:  # int(float("inf")): OverflowError
        mpath.write_text(re.sub(r'"bytes": \d+', '"bytes": Infinity', mpath.read_text()))
        reason = "OverflowError: cannot convert float infinity to integer"
    why = verify(tmp_path, 2, 0)
    assert why == f"manifest {mpath} is unreadable: {reason}", why
    assert latest_complete(tmp_path, 1) == 1 and ckpt.latest() == 1
    with caplog.at_level(logging.WARNING, logger="resilient_comm.checkpoint"):
        step, state = ckpt.load()
    assert step == 1 and torch.equal(state["x"], torch.arange(10.0))
    assert any(str(mpath) in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(CheckpointError, match=re.escape(f"step 2: manifest {mpath} is unreadable: {reason}")):
        ckpt.load(2)
    ckpt.close()


def test_a_file_that_verifies_but_does_not_unpickle_falls_back_and_is_the_cause(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = _saved_twice(tmp_path, 10)
    # Step 2's archive with a pickle that APPENDs to an empty stack (IndexError in torch.load's
    # weights-only unpickler), and a manifest that matches it: only loading can tell.
    path, mpath = pathlib.Path(rank_file(tmp_path, 2, 0)), pathlib.Path(manifest_file(tmp_path, 2, 0))
    out = io.BytesIO()
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w") as zout:
        for name in zin.namelist():
            zout.writestr(name, b"\x80\x02a." if name.endswith("/data.pkl") else zin.read(name))
    path.write_bytes(out.getvalue())
    m = json.loads(mpath.read_text())
    m["bytes"], m["sha256"] = len(out.getvalue()), hashlib.sha256(out.getvalue()).hexdigest()
    mpath.write_text(json.dumps(m))
    assert verify(tmp_path, 2, 0) is None
    with caplog.at_level(logging.WARNING, logger="resilient_comm.checkpoint"):
        step, state = ckpt.load()
    assert step == 1 and torch.equal(state["x"], torch.arange(10.0))
    assert any(f"{path} does not load: IndexError" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(CheckpointError, match=re.escape(f"step 2: {path} does not load: IndexError")) as info:
        ckpt.load(2)
    assert isinstance(info.value.__cause__, IndexError), repr(info.value.__cause__)
    ckpt.close()


def test_background_failure_is_raised_by_wait_and_leaves_no_file(tmp_path: pathlib.Path) -> None:
    ckpt = AsyncCheckpointer(tmp_path, rank=0)
    _save(ckpt, 1, {"x": torch.ones(3)})

    def disk_full(event: str, info: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    ckpt._test_hook = disk_full
    assert ckpt.save(2, {"x": torch.zeros(3)})
    ckpt.wait_snapshot()  # the host copy succeeded; the write failed
    with pytest.raises(CheckpointError, match=r"rank 0 step 2 failed: .*No space left") as e:
        ckpt.wait()
    assert isinstance(e.value.__cause__, OSError)
    assert ckpt.stats.failed == 1 and ckpt.latest() == 1
    assert os.listdir(tmp_path / "step-00000002") == []
    ckpt._test_hook = None
    _save(ckpt, 3, {"x": torch.zeros(3)})
    assert ckpt.latest() == 3
    ckpt.close()
    with pytest.raises(CheckpointError, match="after close"):
        ckpt.save(4, {})


@pytest.mark.parametrize("mode", ["skip", "wait"])
def test_save_while_flushing_skips_or_waits(tmp_path: pathlib.Path, mode: str) -> None:
    ckpt = AsyncCheckpointer(tmp_path, rank=0, if_busy=mode)  # type: ignore[arg-type]
    in_flush, release = threading.Event(), threading.Event()

    def hook(event: str, info: dict[str, Any]) -> None:
        if event == "write":
            in_flush.set()
            assert release.wait(30)
        elif event == "busy":  # save() is about to wait for the flush: let the flush finish
            release.set()

    ckpt._test_hook = hook
    assert ckpt.save(1, {"x": torch.ones(3)})
    assert in_flush.wait(30)
    accepted = ckpt.save(2, {"x": torch.ones(3)})
    release.set()
    ckpt.wait()
    assert accepted == (mode == "wait")
    assert (ckpt.stats.skipped, ckpt.stats.waited) == ((1, 0) if mode == "skip" else (0, 1))
    assert ckpt.latest() == (1 if mode == "skip" else 2)
    ckpt.close()


def test_unsupported_values_are_refused_before_anything_starts(tmp_path: pathlib.Path) -> None:
    with AsyncCheckpointer(tmp_path, rank=0) as ckpt:
        with pytest.raises(TypeError, match=r"state\['opt'\]\[1\] is a builtins.object"):
            ckpt.save(1, {"opt": [1, object()]})
        with pytest.raises(TypeError, match="sparse"):
            ckpt.save(1, {"s": torch.eye(2).to_sparse()})
        assert ckpt.stats.saves == 0 and ckpt.latest() is None


def test_interval_advisor_follows_young_daly() -> None:
    adv = IntervalAdvisor(mtbf_s=3 * 3600.0, restart_s=120.0)
    a = adv.advise(stall_s=60.0)
    assert a.interval_s == pytest.approx(daly_interval(60.0, 3 * 3600.0)) and a.bound == "daly"
    assert a.young_s == pytest.approx(1138.4, abs=0.1)
    assert a.waste == pytest.approx(expected_waste(a.interval_s, 60.0, 3 * 3600.0, 120.0))
    # An async save stalls 50 ms but takes 30 s to become durable: a shorter interval, floored by the flush.
    b = adv.advise(stall_s=0.05, flush_s=30.0, step_s=0.4)
    assert b.interval_s < a.interval_s and b.interval_steps == round(daly_interval(0.05, 3 * 3600.0) / 0.4)
    assert b.waste == pytest.approx(expected_waste(b.interval_s, 0.05, 3 * 3600.0, 150.0))
    c = adv.advise(stall_s=0.001, flush_s=60.0)
    assert c.bound == "flush" and c.interval_s == 60.0
    llama = IntervalAdvisor(gpus=16384, gpu_hours_per_failure=45600)
    assert llama.mtbf_s == pytest.approx(job_mtbf_s(16384, 45600))
    assert IntervalAdvisor(interruptions_per_hour=2).mtbf_s == 1800.0
    with pytest.raises(ValueError, match="exactly one failure rate"):
        IntervalAdvisor(mtbf_s=10.0, interruptions_per_hour=1)


def test_interval_advisor_reads_a_checkpointers_stats(tmp_path: pathlib.Path) -> None:
    with AsyncCheckpointer(tmp_path, rank=0) as ckpt:
        adv = IntervalAdvisor(mtbf_s=3600.0)
        with pytest.raises(ValueError, match="no completed save"):
            adv.advise_from(ckpt.stats)
        _save(ckpt, 1, {"x": torch.ones(1000)})
        a = adv.advise_from(ckpt.stats, step_s=0.1)
    rec = ckpt.stats.history[-1]
    assert rec.nbytes > 4000 and rec.flush_s > 0 and rec.stall_s > 0
    assert (a.cost_s, a.flush_s) == (rec.stall_s, rec.flush_s) and a.interval_steps is not None


def test_bench_checkpoint_runs_tiny(tmp_path: pathlib.Path) -> None:
    from resilient_comm.tools.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "checkpoint", "--width", "32", "--layers", "2", "--batch", "4", "--reps", "2",
               "--dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["params"] == 2 * (32 * 32 + 32)
    assert len(res["async"]["stall_s"]) == 2 and len(res["sync"]["stall_s"]) == 2
    assert res["ratio"] == pytest.approx(res["async"]["median_stall_s"] / res["sync"]["median_stall_s"])
    assert res["checkpointer"]["completed"] == 3 and res["checkpointer"]["skipped"] == 0
