"""`resilient-comm bench compare`: one SIGKILL, the same job under every fault-tolerance stack.

The job (`compare_job`) is a small data-parallel training run: the same model, data and step
time everywhere (``--step-ms`` of sleep standing for compute). In each repetition every stack
runs it once, in an order that rotates between repetitions, so a noisy machine affects them
alike. Once the victim (rank ``world // 2``: not a ring neighbour of rank 0) has committed a
step drawn from the seed with every rank in the job, the bench SIGKILLs it a drawn fraction
of a step after that commit. Measured: the kill -> the first step committed *after the recovery*
by every survivor (for torchrun, by every rank of the restarted job; for the others, the
first step committed with the victim out of the job). Checked: every survivor ends with the
same parameters (a digest of them); a repetition where they differ, or a stack that did not
recover within ``--timeout``, is reported in its row.

Stacks (each written as its own documentation says; the settings column shows what was set):

- ``torchrun``: ``torch.distributed.run --max-restarts 1`` (c10d rendezvous), gloo, a
  checkpoint every 10 steps, restart from it (the seed tutorial's recipe).
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it the restarted workers of torch 2.13
  hang on the old generation's store keys (``bench recovery --torchrun-default``).
- ``reconfigure-gloo``: torch >= 2.14's ``enable_reconfigure`` + ``dist._reconfigure`` on
  gloo. The ranks that are not ring neighbours of the dead one wait out the op timeout, so the
  figure is that timeout: torch's default for gloo is 30 minutes, which the bench does not
  wait out; it runs at ``--gloo-timeout`` (10 s) and says so.
- ``torchft`` (its defaults), ``torchft-example`` (the settings of its train_ddp.py example
  and README: gloo timeout 5 s, Manager timeout 30 s, Lighthouse ``--min_replicas 1
  --quorum_tick_ms 100 --join_timeout_ms 10000``) and ``torchft-fast`` (the fastest settings
  that stayed stable here: ``--torchft-fast``, below).
- ``torchft-fast-ours``: torchft-fast's settings, its Manager given a native torch ProcessGroup
  (``enable_reconfigure=True``) whose CPU backend is ``resilient_tcp`` instead of its gloo
  wrapper: the same recovery protocol, our transport under it.
- ``ours``: the elastic Controller under ``resilient-run`` on ``resilient_tcp``, defaults.
- ``reconfigure-ours``: torch's reconfigure API on ``resilient_tcp`` at torch's default timeout.

Stacks whose package is missing (torchft: ``pip install -e .[bench]``) or whose torch lacks the
API (reconfigure: torch >= 2.14) are reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from resilient_comm.tools.bench.common import free_port, machine, p90
from resilient_comm.tools.bench.compare_job import dead_key

JOB = "resilient_comm.tools.bench.compare_job"
# torchft's fastest settings that recovered in every repetition here (8 ranks, 5 reps each; the
# sweep is in benchmarks/results/compare.md): gloo's and the Manager's timeouts at 50 ms (a
# survivor that is not a ring neighbour of the dead replica waits that long), the Lighthouse
# issuing a quorum 100 ms after the first request. A quorum slower than `quorum_timeout` ends
# the process (TimeoutError): 1 s. These timeouts hold only because this job's all_reduce takes
# about a millisecond and its ranks run in lockstep: a real job's must exceed its slowest
# healthy collective plus the skew between its ranks.
TORCHFT_FAST = {
    "pg_timeout": 0.05,
    "timeout": 0.05,
    "quorum_timeout": 1.0,
    "heartbeat_timeout_ms": 500,
    "join_timeout_ms": 100,
}
# The Lighthouse as torchft's README starts it: --min_replicas 1 --quorum_tick_ms 100
# --join_timeout_ms 10000. (With the Lighthouse's own default join timeout, 60 s, the survivors'
# quorum requests time out at the Manager's default 60 s while the Lighthouse still waits for the
# survivor stuck in gloo's 60 s receive: measured once here, two of three survivors crashed.)
TORCHFT_README = {"join_timeout_ms": 10000, "quorum_tick_ms": 100}
# train_ddp.py, torchft's example: ProcessGroupGloo(timeout=5 s), Manager(timeout=30 s).
TORCHFT_EXAMPLE = {"pg_timeout": 5.0, "timeout": 30.0, **TORCHFT_README}
LIGHTHOUSE_KEYS = ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms")
TARGET_DEFAULTS, TARGET_FASTEST = 10.0, 3.0  # ours must be this many times faster
# How often the bench reads the event files. The bench runs on the cores of the stacks it times,
# so each read takes only the bytes appended since the last (`EventLog`). Before the kill it
# reads the victim's file alone, and the kill's moment is taken from the commit's own time, not
# from when the bench saw it: the poll period delays the kill only when the drawn delay is
# shorter than it. After the kill the reads only decide when the stop file is written (its last
# step counts from the newest step seen), so they can be one step apart.
KILL_POLL_S, RECOVERY_POLL_S = 0.005, 0.05


@dataclass
class Stack:
    name: str
    kind: str  # compare_job --stack
    settings: str  # as shown in the table
    torchft: dict[str, Any] = field(default_factory=dict)
    backend: str = "gloo"
    timeout_s: float = 0.0  # the group's op timeout (0: torch's default)
    default: bool = True  # run at its defaults (the x10 target) or at tuned settings (x3)


def stacks(gloo_timeout: float, fast: dict[str, Any]) -> list[Stack]:
    return [
        Stack("torchrun", "torchrun", "--max-restarts 1, ckpt every 10 steps, gloo"),
        Stack(
            "reconfigure-gloo",
            "reconfigure",
            f"op timeout {gloo_timeout:g} s (default 30 min)",
            timeout_s=gloo_timeout,
        ),
        Stack("torchft", "torchft", "defaults; Lighthouse as its README starts it", torchft=TORCHFT_README),
        Stack(
            "torchft-example", "torchft", _ft_text(TORCHFT_EXAMPLE), torchft=TORCHFT_EXAMPLE, default=False
        ),
        Stack("torchft-fast", "torchft", _ft_text(fast), torchft=fast, default=False),
        Stack(
            "torchft-fast-ours",
            "torchft",
            f"native group on resilient_tcp; {_ft_text(fast)}",
            torchft=fast,
            backend="resilient_tcp",
            default=False,
        ),
        Stack("ours", "ours", "resilient-run + Controller, defaults"),
        Stack(
            "reconfigure-ours",
            "reconfigure",
            "resilient_tcp, torch's default timeout",
            backend="resilient_tcp",
        ),
    ]


def _ft_text(s: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in s.items())


@dataclass
class Run:
    stack: str
    world: int
    rep: int
    ok: bool = False
    kill_step: int | None = None
    recovery_s: float | None = None  # kill -> first commit after the recovery, last survivor
    redone: int | None = None  # steps committed before the kill and again after it
    equal: bool | None = None  # survivors' final parameters equal
    note: str = ""


def _lighthouse_bin() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return here if os.path.exists(here) else shutil.which("torchft_lighthouse") or "torchft_lighthouse"


class EventLog:
    """The ranks' event files (``<rank>-<pid>.jsonl``, `compare_job.Events`), read as they grow:
    each file stays open and a `read` takes only what was appended since the last one, parsing
    complete lines only (a line still being written waits for the next read). Every event read
    so far is in `events`, with the writer's pid."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.events: list[dict[str, Any]] = []
        self._files: dict[str, io.FileIO] = {}
        self._partial: dict[str, bytes] = {}

    def read(self, prefix: str = "") -> list[dict[str, Any]]:
        """Reads the files whose name starts with `prefix` (every file: ""); the new events."""
        new: list[dict[str, Any]] = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:  # no rank has started yet
            return new
        for name in names:
            if not name.startswith(prefix):
                continue
            f = self._files.get(name)
            if f is None:
                f = self._files[name] = open(os.path.join(self.root, name), "rb", buffering=0)  # noqa: SIM115 (closed in close())
            *lines, rest = (self._partial.pop(name, b"") + (f.readall() or b"")).split(b"\n")
            if rest:
                self._partial[name] = rest
            pid = int(name.split("-")[1].split(".")[0])
            new += [{**json.loads(line), "pid": pid} for line in lines]
        self.events += new
        return new

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class Job:
    """One stack's processes, started by the bench."""

    def __init__(self, stack: Stack, world: int, step_ms: float, workdir: str, stop_file: str) -> None:
        self.stack, self.workdir = stack, workdir
        self.events = EventLog(os.path.join(workdir, "events"))
        self.procs: list[subprocess.Popen] = []
        self.log = open(os.path.join(workdir, "job.log"), "wb")  # noqa: SIM115 (closed in close())
        self.lighthouse: Any = None
        self.store: Any = None
        self.exits: _ExitReporter | None = None
        job = [
            "-m", JOB, "--stack", stack.kind, "--events", self.events.root, "--stop-file", stop_file,
            "--step-ms", str(step_ms), "--backend", stack.backend, "--timeout", str(stack.timeout_s),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFT_", "RESILIENT_COMM_"))}
        if stack.kind == "torchrun":
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
                "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                *job, "--ckpt", os.path.join(workdir, "ckpt.pt"),
            ]  # fmt: skip
            self._spawn(cmd, {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        elif stack.kind == "ours":
            cmd = [
                sys.executable,
                "-m",
                "resilient_comm.elastic.node.cli",
                "--nproc-per-node",
                str(world),
                *job,
            ]
            self._spawn(cmd, env)
        elif stack.kind == "reconfigure":
            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            for r in range(world):
                self._spawn(
                    [sys.executable, *job],
                    {**env, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(self.store.port)},
                )  # fmt: skip
            self.exits = _ExitReporter(self.store, self.procs)
        else:
            # The Lighthouse as torchft's README starts it (its command, its flags), on a free port.
            port = free_port()
            flags = [f"--{k}={int(v)}" for k, v in stack.torchft.items() if k in LIGHTHOUSE_KEYS]
            lighthouse = [_lighthouse_bin(), "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", *flags]
            self._spawn(lighthouse, {**env, "RUST_LOG": "warn"})
            self.lighthouse = self.procs.pop()
            ft = json.dumps({k: v for k, v in stack.torchft.items() if k not in LIGHTHOUSE_KEYS})
            for r in range(world):
                self._spawn(
                    [sys.executable, *job, "--torchft", ft],
                    {**env, "REPLICA_GROUP_ID": str(r), "NUM_REPLICA_GROUPS": str(world),
                     "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"},
                )  # fmt: skip

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self.procs.append(
            subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def close(self) -> None:
        if self.exits is not None:
            self.exits.closing.set()
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.events.read()
        for e in self.events.events:  # workers of torchrun and resilient-run
            if e["event"] == "start":
                try:
                    os.kill(e["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()
        self.events.close()
        self.log.close()


class _ExitReporter:
    """What a launcher knows and torch's reconfigure API leaves to the user: which ranks died.
    The k-th rank to exit with an error sets `dead_key(k)` in the job's store to the list of all
    k, the key a survivor that knew of k - 1 waits on (`compare_job.dead_ranks`). One thread per
    child blocks in its wait: no poll competes for the cores with the ranks being timed. After
    `closing` is set (the bench kills what is left), exits are no longer reported."""

    def __init__(self, store: Any, procs: list[subprocess.Popen]) -> None:
        self._store = store
        self._dead: list[int] = []
        self._lock = threading.Lock()
        self.closing = threading.Event()
        for rank, p in enumerate(procs):
            threading.Thread(
                target=self._watch, args=(rank, p), name=f"bench-exit-{rank}", daemon=True
            ).start()

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        if p.wait() == 0 or self.closing.is_set():
            return
        with self._lock:
            self._dead.append(rank)
            self._store.set(dead_key(len(self._dead)), ",".join(map(str, self._dead)))


def run_one(stack: Stack, world: int, rep: int, a: argparse.Namespace, root: str) -> Run:
    rng = random.Random(f"{a.seed}/{world}/{rep}")  # the same fault for every stack
    kill_step = rng.randint(a.kill_after, a.kill_after + 10)
    delay = rng.random() * a.step_ms / 1e3
    victim = world // 2
    run = Run(stack.name, world, rep, kill_step=kill_step)
    workdir = tempfile.mkdtemp(prefix=f"{stack.name}-{world}-{rep}-", dir=root)
    stop_file = os.path.join(workdir, "stop")
    job = Job(stack, world, a.step_ms, workdir, stop_file)
    log, mine = job.events, f"{victim}-"
    try:
        deadline = time.monotonic() + a.timeout
        hit = None
        while hit is None:
            new = log.read(mine)
            hit = next(
                (e for e in new if e["event"] == "commit" and e["step"] >= kill_step and e["world"] == world),
                None,
            )
            if hit is None:
                if time.monotonic() > deadline or job.ended():
                    run.note = f"the victim never reached step {kill_step} with {world} ranks in the job"
                    return run
                time.sleep(KILL_POLL_S)  # pacing a poll of the victim's event file
        pid = hit["pid"]
        time.sleep(max(0.0, hit["t"] + delay - time.time()))  # the drawn moment of the fault
        os.kill(pid, signal.SIGKILL)
        kill_t = time.time()
        log.read(mine)
        run.kill_step = max(e["step"] for e in log.events if e["event"] == "commit" and e["pid"] == pid)
        restarts = stack.kind == "torchrun"
        # Every stack trains until each survivor committed a step after its recovery, then
        # `a.tail` steps more, to a last step every survivor reads before reaching it.
        while True:
            log.read()
            firsts, _, _ = _after(log.events, kill_t, pid, victim, restarts, world)
            if all(t is not None for t in firsts.values()):
                last = max(e["step"] for e in log.events if e["event"] == "commit") + a.tail
                with open(stop_file + ".tmp", "w") as f:
                    f.write(str(last))
                os.replace(stop_file + ".tmp", stop_file)
                break
            if time.monotonic() > deadline or job.ended():
                break
            time.sleep(RECOVERY_POLL_S)  # pacing a poll of the survivors' event files
        if not job.wait(max(1.0, deadline - time.monotonic())):
            run.note = f"not finished within {a.timeout:.0f} s"
        log.read()
        return _measure(run, log.events, kill_t, pid, victim, restarts, world)
    finally:
        job.close()


def _after(
    ev: list[dict[str, Any]], kill_t: float, victim_pid: int, victim: int, restarts: bool, world: int
) -> tuple[dict[int, float | None], list[dict[str, Any]], list[dict[str, Any]]]:
    """Each survivor's first commit after the recovery (None: not yet), those commits, the
    survivors' final records. After the recovery: for torchrun, in the restarted processes
    (every rank); for the others, a step committed after the kill without the victim."""
    if restarts:
        fresh = {e["pid"] for e in ev if e["event"] == "start" and e.get("generation", 0) >= 1}
        after = [e for e in ev if e["event"] == "commit" and e["pid"] in fresh]
        finals = [e for e in ev if e["event"] == "final" and e["pid"] in fresh]
        ranks = set(range(world))
    else:
        after = [e for e in ev if e["event"] == "commit" and e["t"] > kill_t and e["world"] < world]
        finals = [e for e in ev if e["event"] == "final" and e["pid"] != victim_pid]
        ranks = set(range(world)) - {victim}
    return {r: min((e["t"] for e in after if e["rank"] == r), default=None) for r in ranks}, after, finals


def _measure(
    run: Run,
    ev: list[dict[str, Any]],
    kill_t: float,
    victim_pid: int,
    victim: int,
    restarts: bool,
    world: int,
) -> Run:
    """kill -> every survivor's first commit after the recovery; the final digests."""
    firsts, after, finals = _after(ev, kill_t, victim_pid, victim, restarts, world)
    if any(t is None for t in firsts.values()):
        missing = sorted(r for r, t in firsts.items() if t is None)
        run.note = (
            run.note + "; " if run.note else ""
        ) + f"ranks {missing} committed no step after the recovery"
        return run
    run.recovery_s = max(t for t in firsts.values() if t is not None) - kill_t
    before = max((e["step"] for e in ev if e["event"] == "commit" and e["t"] <= kill_t), default=-1)
    run.redone = max(0, before + 1 - min(e["step"] for e in after))
    digests = {e["digest"] for e in finals}
    run.equal = len(digests) == 1 and len(finals) == len(firsts)
    if not run.equal:
        run.note = (run.note + "; " if run.note else "") + (
            f"{len(finals)} of {len(firsts)} survivors finished, {len(digests)} distinct final parameter sets"
        )
    run.ok = run.equal and not run.note
    return run


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "torchft-nightly", "resilient_comm"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _skip_reason(stack: Stack) -> str | None:
    if stack.kind == "torchft":
        try:
            import torchft  # noqa: F401
        except ImportError as e:
            return f"torchft not installed ({e}): pip install -e .[bench]"
    if stack.kind == "reconfigure":
        import torch.distributed as dist

        if not hasattr(dist, "_reconfigure"):
            import torch

            return f"torch {torch.__version__} has no reconfigure API (torch >= 2.14 has)"
    return None


def summarize(
    runs: list[Run], chosen: list[Stack], skipped: dict[str, str], bound_s: float
) -> tuple[list[dict[str, Any]], list[str]]:
    """The table's rows and the targets' verdicts. A target is judged on the runs that recovered;
    a stack that recovered in no run within a run's bound `bound_s` has no figure to compare, and
    its verdict says so: a failure to recover is reported as one, not counted as a target met."""
    rows: list[dict[str, Any]] = []
    verdicts: list[str] = []
    for world in sorted({r.world for r in runs}):
        ours_rs = [
            r.recovery_s for r in runs if r.stack == "ours" and r.world == world and r.recovery_s is not None
        ]
        ours = statistics.median(ours_rs) if ours_rs else None
        for st in chosen:
            rs = [r for r in runs if r.stack == st.name and r.world == world]
            got = [r.recovery_s for r in rs if r.recovery_s is not None]
            med = statistics.median(got) if got else None
            rows.append(
                {
                    "stack": st.name,
                    "world": world,
                    "settings": st.settings,
                    "reps": len(rs),
                    "recovered": len(got),
                    "equal": sum(bool(r.equal) for r in rs),
                    "median_s": med,
                    "p90_s": p90(got) if got else None,
                    "x_ours": med / ours if med is not None and ours else None,
                    "redone": max((r.redone for r in rs if r.redone is not None), default=None),
                    "notes": sorted({r.note for r in rs if r.note}),
                }
            )
        if ours is None:
            continue
        for row in rows:
            if row["world"] != world or row["stack"] == "ours":
                continue
            st = next(s for s in chosen if s.name == row["stack"])
            if st.name == "reconfigure-ours" or (not st.default and st.name != "torchft-fast"):
                continue
            need = TARGET_DEFAULTS if st.default else TARGET_FASTEST
            x, got, reps = row["x_ours"], row["recovered"], row["reps"]
            target = (
                f"target: ours >= {need:g}x faster than {st.name} "
                f"({'defaults' if st.default else 'fastest stable'}) at {world} ranks"
            )
            if x is None:
                verdicts.append(
                    f"{target}: NO FIGURE ({st.name} recovered in none of {reps} runs within the "
                    f"{bound_s:g} s bound of a run)"
                )
                continue
            partial = f"; {st.name} recovered in {got} of {reps} runs" if got < reps else ""
            verdicts.append(f"{target}: {'MET' if x >= need else 'NOT MET'} ({x:.0f}x{partial})")
    for name, why in skipped.items():
        verdicts.append(f"skipped {name}: {why}")
    return rows, verdicts


def table(rows: list[dict[str, Any]]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"

    head = f"{'stack':<17} {'world':>5} {'ok':>5} {'equal':>5} {'kill->commit':>12} {'p90':>9} {'x ours':>7} {'redone':>6}  settings"
    lines = [head, "-" * len(head)]
    for r in rows:
        x = "-" if r["x_ours"] is None else f"{r['x_ours']:.1f}x"
        lines.append(
            f"{r['stack']:<17} {r['world']:>5} {r['recovered']:>2}/{r['reps']:<2} {r['equal']:>5} {s(r['median_s']):>12} "
            f"{s(r['p90_s']):>9} {x:>7} {r['redone'] if r['redone'] is not None else '-':>6}  {r['settings']}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    worlds = sorted({r["world"] for r in rows})
    names = list(dict.fromkeys(r["stack"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(worlds)
    for i, w in enumerate(worlds):
        vals = [
            next((r["median_s"] for r in rows if r["stack"] == n and r["world"] == w), None) for n in names
        ]
        xs = [k + (i - (len(worlds) - 1) / 2) * width for k in range(len(names))]
        bars = ax.bar(xs, [v or 0 for v in vals], width, label=f"{w} ranks")
        floor = min((v for r in rows if (v := r["median_s"])), default=0.01) / 2
        for b, v in zip(bars, vals, strict=True):
            x = b.get_x() + b.get_width() / 2
            if v:
                ax.annotate(f"{v:.2g} s", (x, v), ha="center", va="bottom", fontsize=7)
            else:
                ax.annotate(
                    f"no recovery ({w} ranks)", (x, floor), ha="center", va="bottom", fontsize=6, rotation=90
                )
    ax.set_yscale("log")
    ax.set_ylim(bottom=min((v for r in rows if (v := r["median_s"])), default=0.01) / 2.5)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("SIGKILL -> first commit (s, median)")
    ax.set_title(
        "one SIGKILL in a data-parallel job: kill -> every survivor's first step after recovery", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm bench compare", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[4, 8], help="world sizes (default 4 8)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per stack and size (default 5)")
    p.add_argument("--stacks", nargs="+", default=None, help="a subset of the stacks, by name")
    p.add_argument(
        "--tail", type=int, default=10, help="steps trained after every survivor recovered (default 10)"
    )
    p.add_argument("--step-ms", type=float, default=50.0, help="compute time per step, ms (default 50)")
    p.add_argument("--kill-after", type=int, default=12, help="the victim dies after a step in [K, K+10]")
    p.add_argument("--seed", type=int, default=20261206, help="draws the kill step and moment")
    p.add_argument(
        "--gloo-timeout", type=float, default=10.0, help="gloo's op timeout for reconfigure-gloo, s"
    )
    p.add_argument("--torchft-fast", default=json.dumps(TORCHFT_FAST), help="torchft-fast's settings, JSON")
    p.add_argument("--timeout", type=float, default=150.0, help="bound on one run, s")
    p.add_argument("--json", default=None, metavar="PATH", help="write every run here (and a PNG beside it)")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep each run's logs and events under DIR")
    a = p.parse_args(argv)
    every = stacks(a.gloo_timeout, json.loads(a.torchft_fast))
    unknown = set(a.stacks or []) - {s.name for s in every}
    if unknown:
        p.error(f"unknown stacks {sorted(unknown)}; choose from {[s.name for s in every]}")
    chosen = [s for s in every if a.stacks is None or s.name in a.stacks]
    skipped = {s.name: why for s in chosen if (why := _skip_reason(s))}
    chosen = [s for s in chosen if s.name not in skipped]
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    runs: list[Run] = []
    total, n, started = len(a.world) * a.reps * len(chosen), 0, time.time()
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        root = a.keep or tmp
        os.makedirs(root, exist_ok=True)
        for world in a.world:
            for rep in range(a.reps):
                k = rep % max(1, len(chosen))
                for st in chosen[k:] + chosen[:k]:
                    n += 1
                    r = run_one(st, world, rep, a, root)
                    runs.append(r)
                    fig = "-" if r.recovery_s is None else f"{r.recovery_s:.3f} s"
                    print(
                        f"[{n}/{total} {time.time() - started:.0f} s] {st.name:<17} world {world} rep {rep + 1}: "
                        f"kill (after step {r.kill_step}) -> first commit {fig}"
                        f"{'' if r.equal else ', parameters NOT equal' if r.equal is False else ''}  {r.note}",
                        flush=True,
                    )
    rows, verdicts = summarize(runs, chosen, skipped, a.timeout)
    versions = _versions()
    print()
    print(
        f"SIGKILL of rank world/2 -> every survivor's first step after recovery ({a.reps} reps, medians; "
        f"{a.step_ms:g} ms steps; {', '.join(f'{k} {v}' for k, v in versions.items())}; {time.time() - started:.0f} s)"
    )
    print(table(rows))
    print()
    print("\n".join(verdicts))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"argv": argv, "machine": machine(), "versions": versions, "rows": rows, "verdicts": verdicts,
                 "runs": [asdict(r) for r in runs]},
                f,
                indent=1,
            )  # fmt: skip
        png = os.path.splitext(a.json)[0] + ".png"
        print(f"wrote {a.json}" + (f" and {png}" if plot(rows, png) else " (no matplotlib: no plot)"))
    ok = all(r.ok for r in runs) and all("NOT MET" not in v for v in verdicts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
