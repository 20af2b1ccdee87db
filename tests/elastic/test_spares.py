"""Hot spares end to end: real workers and spares under resilient-run's Launcher, real SIGKILL.

A spare must take a dead rank's place with the world size kept, hold its donor's state bit
for bit before the next step, and end with the parameters of a fault-free run; a spare that
dies while waiting is replaced and disturbs nobody; with more failures than spares the policy
shrinks. Time bounds are loose (a loaded 2-core machine); `resilient-comm bench recovery
--spares 1` measures the targets.
"""

from __future__ import annotations

import datetime
import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient_comm.elastic import Decision, Membership, Mesh, plan
from resilient_comm.elastic.node.launcher import DIED
from resilient_comm.elastic.state.transfer import StateSyncError, digest, pack, unpack
from resilient_comm.testing import wait_for
from resilient_comm.testing.toy import ToyJob

STEPS = 24
WORLD = 4


def run_job(tmp: str, *args: str, spares: int = 1, timeout_s: float = 120.0, **kw: Any) -> tuple[int, ToyJob]:
    # A spare starts as slowly as a worker: on a loaded machine a kill at step 6 or 7 can come
    # before it has registered, and the job then (rightly) shrinks. Rank 0 waits at step 1
    # until the spares are warm (the kills of these tests come later).
    hold = ["--hold", "0:1"] if spares else []
    job = ToyJob(WORLD, ["--steps", str(STEPS), "--digest", "--dump", os.path.join(tmp, "dump"), *args, *hold], tmp,
                 quiet=True, spares=spares, **kw).start()
    if spares:
        m, store = membership(job), job.launcher.client()
        try:
            wait_for(lambda: len(m.spares()) >= spares, "the spares to register")
        finally:
            store.set("toy/go/1", "1")
    return job.wait(timeout_s), job


def final(job: ToyJob, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(job.workdir, "dump", f"final-{rank}.pt"), weights_only=False)


def membership(job: ToyJob) -> Membership:
    return Membership(job.launcher.client(), job.launcher.namespace)


def decisions(job: ToyJob) -> list[Decision]:
    m = membership(job)
    return [d for e in range(m.epoch() + 1) if (d := m.decision(e)) is not None]


def commits(job: ToyJob) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in job.events():
        if e["event"] == "commit":
            out.setdefault(e["rank"], []).append(e["step"])
    return out


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("fault_free"))
    status, job = run_job(tmp, spares=0)
    assert status == 0
    return final(job, 0)["state"]


# -- units: the policy and the state encoding --------------------------------------------


def test_policy_spares_fill_lost_places_and_keep_the_mesh() -> None:
    p = plan(Mesh(dp=4), [2], [7])
    assert p.replaced == ((2, 7),) and p.stay == (0, 1, 2, 3) and p.mesh == Mesh(dp=4) and p.leaves == ()
    # Two failures, one spare: the lower place is filled, the other leaves.
    p = plan(Mesh(dp=4), [1, 2], [9])
    assert p.replaced == ((1, 9),) and p.stay == (0, 1, 3) and p.mesh == Mesh(dp=3) and p.leaves == (2,)
    # A replica with two holes is not worth one spare: the spare saves the replica with one hole.
    p = plan(Mesh(tp=2, dp=3), [0, 1, 4], [8])
    assert p.replaced == ((4, 8),) and p.stay == (2, 3, 4, 5) and p.evicted == () and p.mesh == Mesh(tp=2, dp=2)
    p = plan(Mesh(tp=2, dp=2), [1], [])
    assert p.replaced == () and p.stay == (2, 3)


def test_state_encoding_round_trips_bit_for_bit_and_rejects_bad_input() -> None:
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
             "misc": (1, 2.5, None, "x", True), "bf": torch.ones(3, dtype=torch.bfloat16), "empty": torch.empty(0, 2)}
    header, payload = pack(state)
    back = unpack(header, payload)
    assert digest(back) == digest(state)
    assert list(back["opt"]["state"]) == [0, 1] and back["misc"] == (1, 2.5, None, "x", True)
    with pytest.raises(StateSyncError, match="do not fit"):
        unpack(header, payload[:-1])
    with pytest.raises(StateSyncError, match="not valid JSON"):
        unpack(b"\x80{", payload)
    with pytest.raises(StateSyncError, match=r"tensor bytes \[-4, 0\) do not fit"):
        unpack(b'{"t": "float32", "shape": [1], "at": -4, "n": 4}', payload)
    with pytest.raises(StateSyncError, match="malformed tensor node"):
        unpack(b'{"t": "object", "shape": [1], "at": 0, "n": 4}', payload)
    with pytest.raises(StateSyncError, match="cannot send a object"):
        pack({"x": object()})
    with pytest.raises(StateSyncError, match="malformed"):
        unpack(b'{"pickle": "cos\\nsystem\\n"}', payload)


# -- end to end ---------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_a_spare_takes_the_dead_ranks_place_with_its_peers_state(tmp_path: Any, fault_free: dict[str, Any]) -> None:
    victim, step = 2, 9
    status, job = run_job(str(tmp_path), "--kill", f"{victim}:{step}:synced")
    assert status == 0
    spare = WORLD
    ds = decisions(job)
    assert len(ds) == 2, ds
    d = ds[1]
    assert d.members == [0, 1, spare, 3] and d.slots == [0, 1, 2, 3] and d.joiners == [spare], d
    assert d.mode == "init" and d.restore == "peer" and d.lost == [victim] and d.resume_step == step
    # Before the next step every member holds the same state, bit for bit (tp = 1: all replicas).
    restored = [e for e in job.events() if e["event"] == "restored" and e["epoch"] == 1]
    assert sorted(e["rank"] for e in restored) == [0, 1, 3, spare]
    assert len({e["digest"] for e in restored}) == 1, restored
    assert next(e for e in restored if e["rank"] == spare)["slot"] == victim
    # The training equals the fault-free run's, and no step was lost or applied twice.
    for r in [0, 1, 3, spare]:
        f = final(job, r)
        assert f["members"] == [0, 1, spare, 3] and f["committed"] == STEPS - 1
        assert digest(f["state"]) == digest(fault_free), f"rank {r} differs from the fault-free run"
    c = commits(job)
    assert all(c[r] == list(range(STEPS)) for r in (0, 1, 3)), c
    assert c[spare] == list(range(step, STEPS)), c[spare]
    tl = final(job, spare)["recoveries"][0]
    assert tl["cause"] == "placed as a hot spare" and tl["ms"]["total"] < 5000, tl
    # The pool was refilled: a new spare was started, and stopped at the end.
    spares = [w for w in job.launcher.workers if w.spare]
    assert [w.rank for w in spares] == [spare, spare + 1] and spares[1].status == 128 + signal.SIGTERM
    assert [w.local_rank for w in spares] == [WORLD, victim], "a refill spare takes the freed device"


@pytest.mark.timeout(200)
def test_a_spare_pays_its_warmup_before_it_waits_so_its_placement_stays_fast(tmp_path: Any) -> None:
    # Finding 11 of issue #16: a spare whose provider is built only when it is placed is not
    # warm. `warmup=` (here 1.5 s of CPU, what a first torch._dynamo import costs) runs before
    # the spare registers as waiting; being placed then costs only the state transfer.
    status, job = run_job(str(tmp_path), "--kill", "2:9:synced", "--warmup-burn-ms", "1500")
    assert status == 0
    ev = job.events()
    warm = {e["rank"] for e in ev if e["event"] == "warm"}
    assert warm >= {0, 1, 2, 3, WORLD}, f"warmup ran on {sorted(warm)}"
    registered = next(e["t"] for e in ev if e["event"] == "kill")  # run_job saw the spare registered before
    assert next(e["t"] for e in ev if e["event"] == "warm" and e["rank"] == WORLD) < registered
    tl = final(job, WORLD)["recoveries"][0]
    assert tl["cause"] == "placed as a hot spare" and tl["ms"]["total"] < 1000, tl
    survivors = [final(job, r)["recoveries"][0]["ms"]["total"] for r in (0, 1, 3)]
    assert max(survivors) < 1000, survivors


@pytest.mark.timeout(200)
def test_a_spare_dying_while_waiting_is_replaced_and_disturbs_nobody(tmp_path: Any) -> None:
    hold = 6
    # Rank 0 is held (the others wait for it) until the replacement spare registered: a start
    # of Python and torch that took over 5 s on a loaded 2-core CI machine, and the straggler
    # bound (5 s) evicted the held rank. The bound is not what this test is about.
    job = ToyJob(WORLD, ["--steps", str(STEPS), "--dump", str(tmp_path / "dump"), "--hold", f"0:{hold}"],
                 str(tmp_path), quiet=True, spares=1, env={"RESILIENT_COMM_STRAGGLER_FLOOR_MS": "60000"}).start()
    m = membership(job)
    store = job.launcher.client()
    try:
        wait_for(lambda: m.spares() == [WORLD], "the spare to register")
        first = next(w for w in job.launcher.workers if w.spare)
        os.kill(first.proc.pid, signal.SIGKILL)
        wait_for(lambda: m.spares() == [WORLD, WORLD + 1], "the replacement spare to register")
        wait_for(lambda: store.check([f"toy/held/0/{hold}"]), "rank 0 to reach the held step")
    finally:
        store.set(f"toy/go/{hold}", "1")
    assert job.wait(120) == 0
    assert m.gone([WORLD])[WORLD].detail == DIED
    assert [d.mode for d in decisions(job)] == ["init"], "the spare's death started a recovery"
    for r in range(WORLD):
        f = final(job, r)
        assert f["members"] == list(range(WORLD)) and f["recoveries"] == [] and f["committed"] == STEPS - 1
    assert commits(job) == {r: list(range(STEPS)) for r in range(WORLD)}


@pytest.mark.timeout(200)
def test_two_failures_one_spare_replaces_then_shrinks(tmp_path: Any) -> None:
    status, job = run_job(str(tmp_path), "--kill", "1:6:start", "--kill", "2:14:synced", max_spare_starts=0)
    assert status == 0
    ds = decisions(job)
    assert [(d.mode, d.members, d.joiners) for d in ds[1:]] == [
        ("init", [0, WORLD, 2, 3], [WORLD]),
        ("shrink", [0, WORLD, 3], []),
    ], ds
    assert ds[2].slots == [0, 1, 3] and ds[2].mesh == {"tp": 1, "pp": 1, "dp": 3}
    states = [digest(final(job, r)["state"]) for r in (0, WORLD, 3)]
    assert len(set(states)) == 1
    assert [w.rank for w in job.launcher.workers if w.spare] == [WORLD], "no spare may be started past the budget"


@pytest.mark.timeout(200)
def test_tensor_parallel_spare_gets_the_shard_of_its_tp_peer(tmp_path: Any) -> None:
    status, job = run_job(str(tmp_path), "--tp", "2", "--kill", "1:7:start")
    assert status == 0
    d = decisions(job)[1]
    assert d.members == [0, WORLD, 2, 3] and d.sources == [[WORLD, 3]] and d.mesh == {"tp": 2, "pp": 1, "dp": 2}
    restored = {e["rank"]: e for e in job.events() if e["event"] == "restored" and e["epoch"] == 1}
    assert restored[WORLD]["digest"] == restored[3]["digest"] != restored[0]["digest"] == restored[2]["digest"]
    ref = ToyJob(WORLD, ["--steps", str(STEPS), "--tp", "2", "--dump", str(tmp_path / "ref")], str(tmp_path / "r"),
                 quiet=True).start()
    assert ref.wait(120) == 0
    for r, twin in ((0, 0), (WORLD, 1), (2, 2), (3, 3)):
        mine = torch.load(tmp_path / "dump" / f"final-{r}.pt", weights_only=False)["state"]
        theirs = torch.load(tmp_path / "ref" / f"final-{twin}.pt", weights_only=False)["state"]
        assert digest(mine) == digest(theirs), f"rank {r} differs from fault-free rank {twin}"


def test_launcher_refuses_bad_spare_settings() -> None:
    from resilient_comm.elastic import Launcher

    with pytest.raises(ValueError, match="bad spares"):
        Launcher(["true"], 2, spares=-1)
    with pytest.raises(ValueError, match="bad spares"):
        Launcher(["true"], 2, spares=1, max_spare_starts=-1)


def test_a_spare_outside_resilient_run_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_comm.elastic import Controller

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RESILIENT_COMM_STORE", f"127.0.0.1:{store.port}")
    monkeypatch.setenv("RESILIENT_COMM_NAMESPACE", "t")
    monkeypatch.setenv("RESILIENT_COMM_SPARE", "1")
    monkeypatch.setenv("RESILIENT_COMM_AGENT", "/nonexistent/agent.sock")
    with pytest.raises(RuntimeError, match="spare's id must be >= WORLD_SIZE 2"):
        Controller(None)


@pytest.mark.timeout(200)
def test_without_a_donor_every_member_loads_the_newest_checkpoint(tmp_path: Any) -> None:
    from resilient_comm.checkpoint import latest_complete

    ckpt, hold = str(tmp_path / "ckpt"), 10
    args = ["--steps", "20", "--tp", "2", "--digest", "--dump", str(tmp_path / "dump"), "--ckpt-dir", ckpt,
            "--ckpt-dir-every", "4", "--hold", f"0:{hold}"]
    job = ToyJob(2, args, str(tmp_path), quiet=True, spares=1).start()  # tp = 2, dp = 1: no replica to copy from
    m, store = Membership(job.launcher.client(), job.launcher.namespace), job.launcher.client()
    try:
        wait_for(lambda: m.spares() == [2], "the spare to register")
        wait_for(lambda: store.check([f"toy/held/0/{hold}"]), "rank 0 to reach the held step")
        # A save finds the previous one still flushing is skipped, so which steps exist varies.
        wait_for(lambda: latest_complete(ckpt, 2) is not None, "a checkpoint complete on both ranks")
        newest = latest_complete(ckpt, 2)
        os.kill(job.pid(1), signal.SIGKILL)
    finally:
        store.set(f"toy/go/{hold}", "1")
    assert job.wait(120) == 0
    d = m.decision(1)
    assert d is not None and (d.members, d.restore, d.resume_step, d.sources) == (
        [0, 2], "checkpoint", d.ckpt_step + 1, []), d
    assert newest is not None and newest <= d.ckpt_step < hold, d
    ref = ToyJob(2, ["--steps", "20", "--tp", "2", "--dump", str(tmp_path / "ref")], str(tmp_path / "r"),
                 quiet=True).start()
    assert ref.wait(120) == 0
    for r, twin in ((0, 0), (2, 1)):
        mine = torch.load(tmp_path / "dump" / f"final-{r}.pt", weights_only=False)["state"]
        theirs = torch.load(tmp_path / "ref" / f"final-{twin}.pt", weights_only=False)["state"]
        assert digest(mine) == digest(theirs), f"rank {r} differs from fault-free rank {twin}"


def _join(rank: int, committed: int, pending: int | None = None) -> Any:
    from resilient_comm.elastic import JoinRecord

    return JoinRecord(rank, 0, True, committed, pending)


def test_decision_places_spares_picks_donors_and_falls_back_to_a_checkpoint_or_a_shrink() -> None:
    from resilient_comm.elastic.model.decide import decide

    tp2 = Decision(0, [0, 1, 2, 3], Mesh(tp=2, dp=2).as_dict(), "init", 0)
    joined = {r: _join(r, 9) for r in (0, 2, 3)}
    # A spare takes rank 1's place; its donor holds the same tp shard in the other replica.
    d = decide(1, tp2, joined, {}, {}, [7, 8], lambda n: None, by=0)
    assert (d.members, d.joiners, d.sources, d.restore, d.mode, d.resume_step) == (
        [0, 7, 2, 3], [7], [[7, 3]], "peer", "init", 10)
    assert d.slots == [0, 1, 2, 3] and d.used_spares == [7]
    # dp = 1: no donor for the spare. With a checkpoint complete for 2 ranks, everyone loads it...
    tp2dp1 = Decision(0, [0, 1], Mesh(tp=2).as_dict(), "init", 0)
    d = decide(1, tp2dp1, {0: _join(0, 9)}, {}, {}, [5], lambda n: 7 if n == 2 else None, by=0)
    assert (d.members, d.restore, d.ckpt_step, d.resume_step, d.sources) == ([0, 5], "checkpoint", 7, 8, [])
    # ... without one the spare is not used, and the lone replica cannot shrink: fail.
    d = decide(1, tp2dp1, {0: _join(0, 9)}, {}, {}, [5], lambda n: None, by=0)
    assert d.mode == "fail" and "no replica survived" in d.note and d.joiners == []
    # A member one behind with the step pending rolls forward: it needs no copy.
    dp3 = Decision(0, [0, 1, 2], Mesh(dp=3).as_dict(), "init", 0)
    d = decide(1, dp3, {0: _join(0, 9), 1: _join(1, 8, pending=9)}, {}, {}, [6], lambda n: None, by=0)
    assert (d.members, d.sources, d.resume_step) == ([0, 1, 6], [[6, 0]], 10)


@pytest.mark.timeout(200)
def test_a_spare_frozen_while_waiting_is_suspected_once_placed(tmp_path: Any) -> None:
    hold = 6
    job = ToyJob(WORLD, ["--steps", str(STEPS), "--dump", str(tmp_path / "dump"), "--hold", f"0:{hold}"],
                 str(tmp_path), quiet=True, spares=1, max_spare_starts=0).start()
    m, store = membership(job), job.launcher.client()
    spare = next(w for w in job.launcher.workers if w.spare)
    try:
        wait_for(lambda: m.spares() == [WORLD], "the spare to register")
        wait_for(lambda: store.check([f"toy/held/0/{hold}"]), "rank 0 to reach the held step")
        os.kill(spare.proc.pid, signal.SIGSTOP)  # frozen: alive, but its heartbeat stops
        os.kill(job.pid(2), signal.SIGKILL)
    finally:
        store.set(f"toy/go/{hold}", "1")
    try:
        wait_for(lambda: all(r in m.done([0, 1, 3]) for r in (0, 1, 3)), "the survivors to finish", 90)
    finally:
        os.kill(spare.proc.pid, signal.SIGCONT)  # it finds itself evicted and leaves
    assert job.wait(60) == 0
    ds = decisions(job)
    assert ds[1].joiners == [WORLD] and ds[-1].members == [0, 1, 3], ds
    assert m.gone([WORLD])[WORLD].kind == "suspect", m.gone([WORLD])
    for r in (0, 1, 3):
        f = final(job, r)
        assert f["committed"] == STEPS - 1 and f["members"] == [0, 1, 3]
        assert all(tl["ms"]["total"] < 20000 for tl in f["recoveries"]), f["recoveries"]
