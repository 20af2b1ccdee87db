"""resilient-run: environment, exit status, exit reports, signal forwarding, signals before the
workers start, store failures, restarts.

The workers here are tiny Python scripts (no torch), synchronised with the test through
named pipes: a worker blocks reading its FIFO until the test writes to it.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest
import torch.distributed as dist

from resilient_comm.elastic import Launcher, Membership
from resilient_comm.elastic.node.launcher import DIED, SHUTDOWN_BOUND_S
from resilient_comm.testing import wait_for

LAUNCHER = [sys.executable, "-m", "resilient_comm.elastic"]


def script(tmp: pathlib.Path, name: str, body: str) -> str:
    path = tmp / name
    path.write_text("import json, os, signal, sys, time\n" + body)
    return str(path)


@pytest.mark.timeout(60)
def test_workers_get_torchrun_and_store_variables_and_the_first_failure_is_the_status(tmp_path: pathlib.Path) -> None:
    w = script(tmp_path, "w.py", f"""
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
        "RESILIENT_COMM_STORE", "RESILIENT_COMM_NAMESPACE", "OMP_NUM_THREADS", "RESILIENT_COMM_TOKEN"]
json.dump({{k: os.environ.get(k) for k in keys}}, open(os.path.join({str(tmp_path)!r}, "env" + os.environ["RANK"]), "w"))
sys.exit(3 if os.environ["RANK"] == "2" else 0)
""")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RESILIENT_COMM_TOKEN")}
    out = subprocess.run([*LAUNCHER, "--nproc-per-node", "3", "--rdzv-id", "job7", w], capture_output=True,
                         text=True, timeout=50, check=False, env=env)
    assert out.returncode == 3, out.stderr
    assert "worker 2 (pid" in out.stderr and "exit code 3" in out.stderr, out.stderr
    envs = [json.loads((tmp_path / f"env{r}").read_text()) for r in range(3)]
    for r, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "3", "3")
        assert env["RESILIENT_COMM_STORE"] == f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        assert env["RESILIENT_COMM_NAMESPACE"] == "rc/job7/g0" and env["TORCHELASTIC_RUN_ID"] == "job7"
        assert (env["TORCHELASTIC_USE_AGENT_STORE"], env["TORCHELASTIC_RESTART_COUNT"]) == ("True", "0")
        assert env["OMP_NUM_THREADS"] == "1"
    # One job token for the job (docs/security.md), 256 random bits, never in the store.
    tokens = {env["RESILIENT_COMM_TOKEN"] for env in envs}
    assert len(tokens) == 1 and len(next(iter(tokens)) or "") == 64, tokens


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lock", [False, True], ids=["plain", "liveness-lock"])
def test_a_death_is_reported_at_once_and_the_survivors_are_left_running(tmp_path: pathlib.Path, lock: bool) -> None:
    """A plain script's death is known from its pidfd; one that imported resilient_comm holds
    its liveness lock, and its death is reported from that, before the kernel's teardown."""
    fifos = [tmp_path / f"go{r}" for r in range(3)]
    for fifo in fifos:
        os.mkfifo(fifo)
    w = script(tmp_path, "w.py", ("import resilient_comm\n" if lock else "") + f"""
rank = os.environ["RANK"]
open(os.path.join({str(tmp_path)!r}, "ready" + rank), "w").close()
line = open(os.path.join({str(tmp_path)!r}, "go" + rank)).readline()  # blocks until the test writes
open(os.path.join({str(tmp_path)!r}, "finished" + rank), "w").write(line)
""")
    launcher = Launcher([sys.executable, w], 3)
    launcher.start()
    status: list[int] = []
    watcher = threading.Thread(target=lambda: status.append(launcher.wait()), daemon=True)
    watcher.start()
    client = launcher.client()
    m = Membership(client, launcher.namespace)
    wait_for(lambda: (tmp_path / "ready1").exists(), "rank 1 to start (and hold its lock)")
    os.kill(launcher.workers[1].proc.pid, signal.SIGKILL)
    killed = time.time()
    # The launcher records the death, then posts its event: wait for both.
    client.wait([m.key("gone", 1), m.key("events", 0)], datetime.timedelta(seconds=10))
    reported = time.time() - killed
    g = m.gone([1])[1]
    assert (g.kind, g.detail, g.by) == ("exit", DIED if lock else "killed by SIGKILL", "launcher"), g
    assert 0 <= g.t - killed < 0.5 and reported < 1.0, f"reported {reported:.3f} s after the kill"
    assert m.event(0) == {"kind": "gone", "ranks": [1], "gone": [asdict(g)]}, "the event carries the evidence"
    assert all(launcher.workers[r].proc.poll() is None for r in (0, 2)), "a survivor was stopped"
    for r in (0, 2):
        with open(fifos[r], "w") as f:
            f.write("go\n")
    watcher.join(30)
    # No membership decision (no controller): every worker counts, the victim included.
    assert status == [128 + signal.SIGKILL]
    assert [(tmp_path / f"finished{r}").read_text() for r in (0, 2)] == ["go\n", "go\n"]


@pytest.mark.timeout(60)
def test_sigterm_is_forwarded_to_every_worker(tmp_path: pathlib.Path) -> None:
    for r in (0, 1):
        os.mkfifo(tmp_path / f"ready{r}")
    w = script(tmp_path, "w.py", f"""
def on_term(sig, frame):
    open(os.path.join({str(tmp_path)!r}, "term" + os.environ["RANK"]), "w").write(str(sig))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
with open(os.path.join({str(tmp_path)!r}, "ready" + os.environ["RANK"]), "w") as f:
    f.write(os.environ["RANK"] + "\\n")
while True:
    signal.pause()
""")
    proc = subprocess.Popen([*LAUNCHER, "--nproc-per-node", "2", w], stderr=subprocess.PIPE, text=True)
    for r in (0, 1):  # each worker has installed its handler
        assert (tmp_path / f"ready{r}").read_text() == f"{r}\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert [(tmp_path / f"term{r}").read_text() for r in (0, 1)] == [str(int(signal.SIGTERM))] * 2
    assert "ended during shutdown" in err and "reported to the membership" not in err, err


@pytest.mark.timeout(60)
def test_node_zero_of_a_multi_node_job_exits_on_sigterm_though_a_node_never_arrived(tmp_path: pathlib.Path) -> None:
    """Node 0 of 2, node 1 never started: SIGTERM (scancel, a pod's deletion) ends its workers,
    and the launcher itself within the shutdown grace, naming the node it left without."""
    os.mkfifo(tmp_path / "ready0")
    w = script(tmp_path, "w.py", f"""
with open(os.path.join({str(tmp_path)!r}, "ready" + os.environ["RANK"]), "w") as f:
    f.write("up\\n")
while True:
    signal.pause()
""")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen([*LAUNCHER, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint, w],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert (tmp_path / "ready0").read_text() == "up\n"  # its worker runs
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        proc.kill()  # a launcher that did not exit (the bug) must not outlive the test
    assert proc.returncode == 128 + signal.SIGTERM, err  # its worker's status: killed by SIGTERM
    assert took < 5.0, f"{took:.1f} s after SIGTERM (the bound: SHUTDOWN_BOUND_S)"
    assert "ended during shutdown: killed by SIGTERM" in err, err
    assert "leaving without node(s) 1" in err, err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
def test_sigterm_during_the_first_health_check_kills_the_check_and_exits_143(tmp_path: pathlib.Path) -> None:
    """SIGTERM (scancel, a pod's deletion) while the health check before joining runs: the
    launcher kills the check's process group (no orphan) and exits 128+15 at once, saying why."""
    for fifo in ("checking", "never"):
        os.mkfifo(tmp_path / fifo)
    check = script(tmp_path, "check.py", f"""
with open(os.path.join({str(tmp_path)!r}, "checking"), "w") as f:
    f.write(str(os.getpid()) + "\\n")
open(os.path.join({str(tmp_path)!r}, "never")).read()  # blocks: nobody writes to it
""")
    w = script(tmp_path, "w.py", "")
    proc = subprocess.Popen([*LAUNCHER, "--health-check", f"exec {shlex.quote(sys.executable)} {shlex.quote(check)}", w],
                            stderr=subprocess.PIPE, text=True)
    pid = 0
    try:
        pid = int((tmp_path / "checking").read_text())  # the check runs (exec: the launcher's child)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - signalled
        orphan = _alive(pid)
    finally:
        proc.kill()
        if pid and _alive(pid):  # an orphaned check (the bug) must not outlive the test
            os.killpg(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not orphan, f"the health check (pid {pid}) outlived its launcher"
    assert took < SHUTDOWN_BOUND_S, f"{took:.1f} s after SIGTERM"
    last = err.strip().splitlines()[-1]
    assert "shut down by SIGTERM during the health check" in last and "its process group was killed" in last, err
    assert "started nothing (exit status 143)" in last, err


@pytest.mark.timeout(60)
def test_sigterm_while_waiting_for_the_store_exits_143_at_once(tmp_path: pathlib.Path) -> None:
    """A node whose store accepts its connection and never answers (the launcher waits in
    TCPStore's C++ connect, where no Python signal handler runs): SIGTERM still ends it at once
    with 128+15, naming the store it was joining."""
    w = script(tmp_path, "w.py", "")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        proc = subprocess.Popen([*LAUNCHER, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint, w],
                                stderr=subprocess.PIPE, text=True)
        try:
            listener.settimeout(30)
            conn, _ = listener.accept()  # the launcher is connecting to its store
            with conn:
                signalled = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=30)
                took = time.monotonic() - signalled
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert took < SHUTDOWN_BOUND_S, f"{took:.1f} s after SIGTERM"
    last = err.strip().splitlines()[-1]
    assert f"shut down by SIGTERM while joining the job (its store: {endpoint}, c10d)" in last, err


@pytest.mark.timeout(60)
def test_a_store_that_cannot_be_hosted_or_reached_is_named_in_the_error(tmp_path: pathlib.Path) -> None:
    """Node 0 whose store's port is taken, and a node whose etcd cluster does not answer: exit
    status 1 and a message naming the store (not one about --metrics-port)."""
    w = script(tmp_path, "w.py", "")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        nobody = _free_endpoint()
        runs = {
            "host": subprocess.Popen([*LAUNCHER, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", busy, w],
                                     stderr=subprocess.PIPE, text=True),
            "reach": subprocess.Popen([*LAUNCHER, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", nobody,
                                       w], stderr=subprocess.PIPE, text=True),
        }
        errs = {k: p.communicate(timeout=50)[1] for k, p in runs.items()}
    assert {k: p.returncode for k, p in runs.items()} == {"host": 1, "reach": 1}, errs
    assert f"resilient-run: could not host the job's store at {busy} (c10d): " in errs["host"], errs["host"]
    assert "EADDRINUSE" in errs["host"], errs["host"]
    assert f"resilient-run: could not reach the job's store at etcd://{nobody} to take a place: " in errs["reach"], errs


@pytest.mark.timeout(60)
def test_max_restarts_restarts_the_group_when_nobody_survives(tmp_path: pathlib.Path) -> None:
    w = script(tmp_path, "w.py", f"""
gen = os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join({str(tmp_path)!r}, f"ran{{gen}}-{{os.environ['RANK']}}"), "w").write(os.environ["RESILIENT_COMM_NAMESPACE"])
sys.exit(1 if gen == "0" else 0)
""")
    out = subprocess.run([*LAUNCHER, "--nproc-per-node", "2", "--max-restarts", "2", "--rdzv-id", "r", w],
                         capture_output=True, text=True, timeout=50, check=False)
    assert out.returncode == 0, out.stderr
    assert "restart 1 of 2" in out.stderr, out.stderr
    assert sorted(p.name for p in tmp_path.glob("ran*")) == ["ran0-0", "ran0-1", "ran1-0", "ran1-1"]
    assert (tmp_path / "ran1-0").read_text() == "rc/r/g1"
    failed = subprocess.run([*LAUNCHER, "--nproc-per-node", "2", w], capture_output=True, text=True, timeout=50,
                            check=False)
    assert failed.returncode == 1, "without --max-restarts the failure is the status"


def test_bad_command_lines_are_refused() -> None:
    with pytest.raises(SystemExit):
        from resilient_comm.elastic.node.cli import parser

        parser().parse_args(["--nnodes", "4:1", "x.py"])
    with pytest.raises(ValueError, match="single node"):
        Launcher(["true"], 2, nnodes=2, node_rank=0, endpoint="127.0.0.1:0", max_restarts=1)


def test_nnodes_takes_n_or_a_min_max_range() -> None:
    from resilient_comm.elastic.node.cli import parser

    assert [parser().parse_args([*a, "x.py"]).nnodes for a in ([], ["--nnodes", "3"], ["--nnodes", "3:3"],
                                                              ["--nnodes", "2:5"])] == [None, (3, 3), (3, 3), (2, 5)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("args", "error"), [
    (["--nnodes", "4:2"], "argument --nnodes: '4:2': MIN 4 is more than MAX 2"),
    (["--nnodes", "0:2"], "argument --nnodes: '0:2': a job needs at least 1 node (MIN >= 1)"),
    (["--nnodes", "2:x"], "argument --nnodes: '2:x' is not N or MIN:MAX (whole numbers of nodes)"),
    (["--nnodes", "2:3", "--node-rank", "3"], "--node-rank 3 is out of range: --nnodes 2:3 numbers the nodes 0 to 2"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is out of range: --nnodes 2:2 numbers the nodes 0 to 1"),
    (["--nnodes", "1:2", "--max-restarts", "1"], "--max-restarts needs a single node"),
    (["--nnodes", "2:3", "--node-rank", "2", "--spares", "0"],
     "node 2 is a capacity node (--nnodes 2:3: nodes 2 to 2 run only spares) and --spares 0 leaves it nothing"),
])
def test_bad_node_ranges_are_refused_with_a_clear_error(args: list[str], error: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from resilient_comm.elastic.node.cli import main

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:  # before any store is reached (none listens on port 1)
        main([*args, "--rdzv-endpoint", "127.0.0.1:1", "x.py"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and error in err and err.startswith("usage: resilient-run"), err
    assert time.monotonic() - t0 < 5.0


@pytest.mark.timeout(60)
def test_a_capacity_node_runs_only_spares_numbered_by_the_most_nodes(tmp_path: pathlib.Path) -> None:
    """--nnodes 1:2: node 0 runs the job's two workers (and one spare); node 1 joins as spare
    capacity: no workers, --nproc-per-node spares by default, ids interleaved by MAX with node
    0's, its devices from 0. It announces itself to node 0's agent; both launchers exit 0."""
    for r in (0, 1):
        os.mkfifo(tmp_path / f"go{r}")
    w = script(tmp_path, "w.py", f"""
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "RESILIENT_COMM_SPARE"]
json.dump([os.environ.get(k) for k in keys], open(os.path.join({str(tmp_path)!r}, "env" + os.environ["RANK"]), "w"))
if not os.environ.get("RESILIENT_COMM_SPARE"):
    open(os.path.join({str(tmp_path)!r}, "go" + os.environ["RANK"])).readline()  # blocks until the test writes
""")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    node0 = Launcher([sys.executable, w], 2, nnodes=1, max_nodes=2, node_rank=0, endpoint=endpoint, run_id="cap",
                     spares=1)
    status: dict[int, int] = {}
    t0 = threading.Thread(target=lambda: status.__setitem__(0, node0.run()), daemon=True)
    t0.start()
    node1 = Launcher([sys.executable, w], 2, nnodes=1, max_nodes=2, node_rank=1, endpoint=endpoint, run_id="cap")
    assert node1.capacity and node1.spares == 2 and not node0.capacity
    status[1] = node1.run()  # its spares end at once (a plain script): so does the node
    # Node 0's spare must have started (and written its environment) before the job ends, or it
    # is stopped as not needed first: seen on a loaded CI machine.
    deadline = time.monotonic() + 30
    while not (tmp_path / "env2").exists():
        assert time.monotonic() < deadline, "node 0's spare never started"
        time.sleep(0.01)  # pacing of a poll the spare's file ends
    for r in (0, 1):
        with open(tmp_path / f"go{r}", "w") as f:
            f.write("go\n")
    t0.join(30)
    assert status == {0: 0, 1: 0}
    m = Membership(node0.client(), node0.namespace)
    events = [e for i in range(8) if (e := m.event(i)) is not None]
    assert {"kind": "node", "node": 1} in events, events
    assert node0._agent().present == {0, 1} and node1._agent().present == {0, 1}
    got = {int(p.name[3:]): json.loads(p.read_text()) for p in tmp_path.glob("env*")}
    # RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, RESILIENT_COMM_SPARE
    assert got == {0: ["0", "0", "2", "2", "0", "2", None], 1: ["1", "1", "2", "2", "0", "2", None],
                   2: ["2", "2", "2", "2", "0", "2", "1"],  # node 0's spare: W + 0 * MAX + 0
                   3: ["3", "0", "2", "2", "1", "2", "1"], 5: ["5", "1", "2", "2", "1", "2", "1"]}, got


@pytest.mark.timeout(60)
def test_two_nodes_share_node_zeros_store_and_number_ranks_statically(tmp_path: pathlib.Path) -> None:
    w = script(tmp_path, "w.py", f"""
open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"]), "w").write(
    " ".join(os.environ[k] for k in ("LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "RESILIENT_COMM_STORE")))
""")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    node0 = Launcher([sys.executable, w], 2, nnodes=2, node_rank=0, endpoint=endpoint, run_id="mn")
    status: dict[int, int] = {}
    t0 = threading.Thread(target=lambda: status.__setitem__(0, node0.run()), daemon=True)
    t0.start()
    node1 = Launcher([sys.executable, w], 2, nnodes=2, node_rank=1, endpoint=endpoint, run_id="mn")
    status[1] = node1.run()
    t0.join(30)
    assert status == {0: 0, 1: 0}
    got = {r: (tmp_path / f"rank{r}").read_text().split() for r in range(4)}
    assert got == {r: [str(r % 2), "4", str(r // 2), endpoint] for r in range(4)}


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.timeout(90)
def test_identical_commands_take_their_node_ranks_from_the_rendezvous(tmp_path: pathlib.Path) -> None:
    """Two identical ``resilient-run --nnodes 2`` commands (no --node-rank) on one c10d endpoint:
    the one that binds it hosts the store and is node 0, the other node 1."""
    w = script(tmp_path, "w.py", f"""
open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"]), "w").write(os.environ["GROUP_RANK"])
""")
    cmd = [*LAUNCHER, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", _free_endpoint(), "--rdzv-id", "r1", w]
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    nodes = sorted(int(e.split("this node is node ")[1].split()[0]) for e in errs)
    assert nodes == [0, 1], errs
    assert sum("is not this node's to host" in e for e in errs) == 1, "one hosts the store, the other is its client"
    assert {r: (tmp_path / f"rank{r}").read_text() for r in range(4)} == {0: "0", 1: "0", 2: "1", 3: "1"}


@pytest.mark.timeout(60)
def test_a_node_with_no_place_or_too_few_nodes_fails_clearly_and_sigterm_ends_the_wait(tmp_path: pathlib.Path) -> None:
    w = script(tmp_path, "w.py", "")
    endpoint = _free_endpoint()
    # One node of two, join_timeout 2 s: a clear error naming the missing place, in time.
    t0 = time.monotonic()
    out = subprocess.run([*LAUNCHER, "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-conf", "join_timeout=2", w],
                         capture_output=True, text=True, timeout=30, check=False)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stderr
    assert "only 1 of the job's 2 nodes arrived in 2 s (missing: node place(s) [1])" in out.stderr, out.stderr
    assert took < 2.0 + 10.0, f"{took:.1f} s (the rest: the launcher's start, torch's import on a busy machine)"
    # Waiting for the other node, SIGTERM (scancel, a pod's deletion): out at once, saying so.
    proc = subprocess.Popen([*LAUNCHER, "--nnodes", "2", "--rdzv-endpoint", _free_endpoint(), w],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # until it waits for the job's nodes (its handlers are in place)
        if "waiting for the job's 2 nodes" in line:
            break
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    took = time.monotonic() - signalled
    assert proc.returncode == 128 + signal.SIGTERM and "shut down by SIGTERM while waiting for the job's nodes" in err, err
    assert took < 2.0, f"{took:.1f} s after SIGTERM"
    with pytest.raises(SystemExit):
        from resilient_comm.elastic.node.cli import main

        main(["--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-conf", "join_timeout=soon", w])


@pytest.mark.timeout(30)
def test_places_are_drawn_once_and_a_returning_node_takes_a_free_capacity_place() -> None:
    from resilient_comm.elastic.node import rendezvous

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    # c10d: the host is node 0, the others draw 1, 2; a static job has no place for a fourth.
    assert rendezvous.claim(store, "c", 3, 3, "h", True, None) == 0
    assert [rendezvous.claim(store, "c", 3, 3, f"n{i}", False, None) for i in (1, 2)] == [1, 2]
    with pytest.raises(rendezvous.RendezvousError, match=r"no place for this node: the job's 3 node place\(s\) were all "
                       r"taken \(4 nodes arrived so far\) and --nnodes MIN:MAX with MAX > MIN"):
        rendezvous.claim(store, "c", 3, 3, "late", False, None)
    # etcd-like (places checked for life): 2 job places and 2 capacity; once all are drawn a
    # returning node takes the capacity place whose holder is gone, never a job place.
    alive = {0: True, 1: False, 2: True, 3: False}
    got = [rendezvous.claim(store, "e", 2, 4, f"n{i}", False, alive.__getitem__) for i in range(4)]
    assert got == [0, 1, 2, 3]
    assert rendezvous.claim(store, "e", 2, 4, "back", False, alive.__getitem__) == 3
    assert store.get("rc/e/rdzv/place/3") == b"back"
    alive[3] = True
    with pytest.raises(rendezvous.RendezvousError, match="its 2 capacity place"):
        rendezvous.claim(store, "e", 2, 4, "again", False, alive.__getitem__)
    # Spare ids go on from the place's earlier holders' (no id used twice).
    assert rendezvous.first_spare(store, "e", 3) == 0
    rendezvous.spare_started(store, "e", 3)
    assert rendezvous.first_spare(store, "e", 3) == 1


@pytest.mark.timeout(30)
def test_a_dead_workers_teardown_yields_for_a_bounded_time_then_gets_its_policy_back() -> None:
    """[Note: the teardown yields] The launcher makes the threads of a process whose liveness
    lock said "died" SCHED_IDLE and puts them back TEARDOWN_YIELD_S later (shown on a live
    process with three threads: a dead one's teardown is over before anything can look)."""
    from resilient_comm.elastic.node import launcher

    if not launcher._MAY_RESTORE:
        pytest.skip("no CAP_SYS_NICE and RLIMIT_NICE < 20: the launcher leaves a teardown alone")
    body = "import threading, sys, time\n" + "for _ in range(2): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    child = subprocess.Popen([sys.executable, "-c", body + "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 3, tids
        t0 = time.monotonic()
        launcher._yield_teardown(child.pid)
        assert [os.sched_getscheduler(t) for t in tids] == [os.SCHED_IDLE] * 3
        wait_for(lambda: all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in tids), "the policy put back", 5)
        took = time.monotonic() - t0
        assert launcher.TEARDOWN_YIELD_S <= took < launcher.TEARDOWN_YIELD_S + 1.0, took
    finally:
        child.kill()
        child.wait()
