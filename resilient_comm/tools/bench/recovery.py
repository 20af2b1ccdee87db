"""`resilient-comm bench recovery`: SIGKILL -> first committed step, ours against torchrun.

Both systems train the same model (`resilient_comm.testing.toy`: same data, same steps, the
same checkpoint cadence), and in both one worker SIGKILLs itself at the start of the same
step, after writing the time of its death. Per repetition and world size, alternating:

- **ours**: ``resilient-run`` (an in-process `Launcher`) and the elastic `Controller` on
  ``resilient_tcp``; the survivors detect, agree, shrink and go on in the same processes.
  Measured: kill -> the last survivor's first committed step; kill -> detection (every
  survivor knows), kill -> the launcher's report reaching the survivors; the phases of the
  recovery timeline; steps redone.
- **torchrun**: ``torch.distributed.run --max-restarts 1 --rdzv-backend c10d`` with gloo and
  checkpoint/restart (the toy's ``--baseline``): torchrun kills the survivors, restarts every
  worker, they rendezvous, load the checkpoint and go on. Measured: kill -> the first step
  committed after the restart (the last rank's). With torch 2.13 the restarted generation
  hangs unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the rendezvous store keeps the
  old generation's keys), so that variable is set; ``--torchrun-default`` adds runs without
  it, reported as "no recovery" after ``--torchrun-timeout``.
- **the tutorial's script** (`resilient_comm.examples.elastic_train`; ``--no-scripts`` leaves it
  out), under ``resilient-run``: with its ``@restartable`` line (system in-process-restart: the
  survivors' ``main`` is unwound and called again in the same processes, which load the
  checkpoint), and without it under ``--max-restarts 1`` (max-restarts: the survivors fail,
  every process starts again, imports torch and loads the checkpoint). The victim is
  SIGKILLed from the bench once it logged step ``--kill-step``. Measured: kill -> the last
  rank's first step after it.
- **hot spare** (``--spares K``, system ``ours-spare``): the same job under ``resilient-run
  --spares K``; the spare is warm (registered) before the kill, takes the dead rank's place
  and receives its state from a peer. Measured: kill -> the first step committed by every
  member with the world size restored (the spare's included). ``--features``/``--hidden``/
  ``--dtype`` size the model (``--features 2500 --hidden 4000 --dtype float32``: ~10M
  parameters, the issue's setting).
- **heartbeats alone** (``--sigstop-reps``): a worker is SIGSTOPped (no exit, no socket
  error: only its silent heartbeat tells), then measured: stop -> suspicion reaching the
  survivors, stop -> first committed step without it.

"Redone" counts steps whose work was done before the failure and again after it: the step in
flight and, for torchrun, every step since the last checkpoint. The report gives medians and
p90 over repetitions, the targets, the machine, and (``--json``) every run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from resilient_comm.testing.toy import ToyJob, read_events
from resilient_comm.tools.bench.common import free_port, machine

FIX = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TARGETS = {4: 0.5, 8: 1.0}  # s, kill -> first committed step, median
INPROCESS_TARGET = 0.5  # s, kill -> first step of the tutorial's script restarted in-process, median
SPARE_TARGET = 2.5  # s, kill -> first committed step with the world size restored, median


@dataclass
class Run:
    """One repetition of one system."""

    system: str  # ours, torchrun, torchrun-default, ours-sigstop
    nproc: int
    rep: int
    recovered: bool
    fault_t: float | None = None  # wall time of the kill (or the stop)
    first_commit_s: float | None = None  # fault -> first step committed after it (last survivor)
    detected_s: float | None = None  # fault -> every survivor knows (ours)
    exit_report_s: float | None = None  # kill -> the launcher's report reaches survivors (ours)
    suspicion_s: float | None = None  # stop -> heartbeat suspicion reaches survivors (ours-sigstop)
    resume_step: int | None = None
    redone: int | None = None
    world_after: int | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    timelines: list[dict[str, Any]] = field(default_factory=list)  # ours: each survivor's
    nccl_emulator: list[dict[str, Any]] = field(
        default_factory=list
    )  # ours on the emulated NCCL: each survivor's stats
    compared: list[int] = field(default_factory=list)  # ours: steps after which the replicas agreed
    note: str = ""


@dataclass
class Settings:
    steps: int
    kill_step: int
    ckpt_every: int
    step_ms: float
    timeout_s: float
    features: int = 16
    hidden: int = 32
    dtype: str = "float64"
    backend: str = "resilient_tcp"

    def toy_args(self, workdir: str) -> list[str]:
        return [
            "--steps",
            str(self.steps),
            "--ckpt",
            os.path.join(workdir, "ckpt.pt"),
            "--ckpt-every",
            str(self.ckpt_every),
            "--step-ms",
            str(self.step_ms),
            "--features",
            str(self.features),
            "--hidden",
            str(self.hidden),
            "--dtype",
            self.dtype,
            "--backend",
            self.backend,
        ]

    @property
    def params(self) -> int:
        return self.hidden * (self.features + 5) + 4


def _from_timelines(run: Run, fault_t: float, events: list[dict[str, Any]]) -> None:
    """Fill `run` from the survivors' recovery timelines."""
    every = [e["timeline"] for e in events if e["event"] == "recovery"]
    tls = [tl for tl in every if tl["cause"] != "placed as a hot spare"]  # survivors' (detection)
    if not tls:
        return
    run.recovered, run.timelines, run.fault_t = True, every, fault_t
    run.first_commit_s = max(tl["t"]["first_commit"] for tl in every) - fault_t
    run.detected_s = max(tl["t"]["detected"] for tl in tls) - fault_t
    reports = [tl["via"]["exit_report"] for tl in tls if "exit_report" in tl["via"]]
    run.exit_report_s = max(reports) - fault_t if len(reports) == len(tls) else None
    suspicions = [tl["via"]["suspicion"] for tl in tls if "suspicion" in tl["via"]]
    run.suspicion_s = max(suspicions) - fault_t if len(suspicions) == len(tls) else None
    run.resume_step = tls[0]["resume_step"]
    run.world_after = len(tls[0]["members"])
    run.phases_ms = {p: statistics.median(tl["ms"][p] for tl in tls) for p in tls[0]["ms"]}
    last = max([e["step"] for e in events if e["event"] == "commit" and e["t"] < fault_t], default=-1)
    run.redone = last + 2 - run.resume_step


def run_ours(
    nproc: int, rep: int, s: Settings, root: str, sigstop: bool = False, spares: int = 0, lock: bool = True
) -> Run:
    """`lock`: False runs the workers with RESILIENT_COMM_LIVENESS=0 (system "ours-no-lock"):
    a death is known only once the kernel's teardown closed the process's files."""
    from resilient_comm.elastic.membership.protocol import Membership

    workdir = tempfile.mkdtemp(prefix=f"ours{nproc}-{rep}-", dir=root)
    victim = nproc // 2
    fault = ["--mark", f"{victim}:{s.kill_step}"] if sigstop else ["--kill", f"{victim}:{s.kill_step}:start"]
    hold = s.kill_step - 1
    if spares:
        fault += ["--hold", f"0:{hold}"]  # the spares register before the kill (they start in ~1-2 s)
    env = {} if lock else {"RESILIENT_COMM_LIVENESS": "0"}
    job = ToyJob(nproc, [*s.toy_args(workdir), *fault], workdir, quiet=True, spares=spares, env=env).start()
    system = "ours-sigstop" if sigstop else "ours-spare" if spares else "ours" if lock else "ours-no-lock"
    run = Run(system, nproc, rep, False)
    if spares:
        client = job.launcher.client()
        m = Membership(client, job.launcher.namespace)
        deadline = time.monotonic() + s.timeout_s
        while len(m.spares()) < spares and time.monotonic() < deadline:
            time.sleep(0.05)  # pacing a bounded poll for the registration
        client.wait([f"toy/held/0/{hold}"])
        client.set(f"toy/go/{hold}", "1")
    fault_t = None
    if sigstop:
        client = job.launcher.client()
        client.wait([f"toy/at/{victim}/{s.kill_step}"])
        os.kill(job.pid(victim), signal.SIGSTOP)
        fault_t = time.time()
        m = Membership(client, job.launcher.namespace)
        client.wait([m.key("e", 1, "decision")])
        os.kill(job.pid(victim), signal.SIGCONT)  # it finds itself evicted and leaves
    try:
        status = job.wait(s.timeout_s)
    except TimeoutError as e:
        run.note = str(e)
        return run
    events = job.events()
    if fault_t is None:
        fault_t = next((e["t"] for e in events if e["event"] == "kill"), None)
    if fault_t is None:
        run.note = "the victim never reached its step"
        return run
    _from_timelines(run, fault_t, events)
    run.nccl_emulator = [e["stats"] for e in events if e["event"] == "nccl_emulator"]
    run.compared = sorted({e["step"] for e in events if e["event"] == "agreed"})
    run.note = f"launcher status {status}"
    return run


SCRIPT_STEP = re.compile(r"step=(\d+) world=(\d+) sum=\d+ t=([\d.]+)")
PLAIN = "import resilient_comm.examples.elastic_train as m; m.main.__wrapped__()"  # without @restartable


def run_script(nproc: int, rep: int, s: Settings, root: str, system: str) -> Run:
    """The tutorial's script (resilient_comm.examples.elastic_train) under resilient-run: with
    its ``@restartable`` (system in-process-restart), or without it under ``--max-restarts 1``
    (max-restarts: every process starts again). The victim is SIGKILLed from here once it
    logged step `kill_step`; measured: kill -> the last survivor's first step after it."""
    from resilient_comm.elastic.node.launcher import Launcher

    workdir = tempfile.mkdtemp(prefix=f"{system}{nproc}-{rep}-", dir=root)
    logs = os.path.join(workdir, "logs")
    cmd = (
        [sys.executable, "-u", "-m", "resilient_comm.examples.elastic_train"]
        if system == "in-process-restart"
        else [sys.executable, "-u", "-c", PLAIN]
    )
    env = {
        "ELASTIC_CKPT": os.path.join(workdir, "ckpt.pt"),
        "ELASTIC_STEPS": str(s.steps),
        "ELASTIC_SLEEP_S": str(max(s.step_ms, 10.0) / 1e3),
    }
    run = Run(system, nproc, rep, False)
    launcher = Launcher(
        cmd, nproc, max_restarts=0 if system == "in-process-restart" else 1, log_dir=logs, env=env
    )
    victim = nproc // 2

    def steps(gen: int, rank: int) -> list[tuple[int, int, float]]:
        try:
            with open(os.path.join(logs, str(gen), f"{rank}.log")) as f:
                return [(int(a), int(b), float(c)) for a, b, c in SCRIPT_STEP.findall(f.read())]
        except FileNotFoundError:
            return []

    status: list[int] = []
    launcher.start()
    waiter = threading.Thread(
        target=lambda: status.append(launcher.wait()), name="bench-launcher", daemon=True
    )
    waiter.start()
    deadline = time.monotonic() + s.timeout_s
    while not any(st == s.kill_step for st, _, _ in steps(0, victim)):
        if time.monotonic() > deadline or not waiter.is_alive():
            launcher.forward(signal.SIGKILL)
            waiter.join()
            run.note = "the victim never reached its step"
            return run
        time.sleep(0.005)  # pacing a bounded poll of the victim's log
    os.kill(launcher.workers[victim].proc.pid, signal.SIGKILL)
    kill_t = time.time()
    waiter.join(max(0.0, deadline - time.monotonic()))
    if waiter.is_alive():
        launcher.forward(signal.SIGKILL)
        waiter.join()
        run.note = f"not finished within {s.timeout_s:.0f} s"
        return run
    gen = 0 if system == "in-process-restart" else 1
    ranks = [r for r in range(nproc) if r != victim] if gen == 0 else list(range(nproc))
    firsts = [[x for x in steps(gen, r) if x[2] > kill_t][:1] for r in ranks]
    before = max(st for st, _, t in steps(0, 0) if t < kill_t)
    if not all(firsts):
        run.note = f"launcher status {status[0]}; not every rank stepped after the kill"
        return run
    run.recovered, run.fault_t = True, kill_t
    run.first_commit_s = max(f[0][2] for f in firsts) - kill_t
    run.resume_step = min(f[0][0] for f in firsts)
    run.world_after = firsts[0][0][1]
    run.redone = before + 1 - run.resume_step
    run.note = f"launcher status {status[0]}"
    return run


def _end(proc: subprocess.Popen, events_dir: str) -> None:
    """Stop a torchrun that did not finish, then any of its workers still alive (their pids
    are in their event files' names: they run in sessions of their own)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for name in os.listdir(events_dir) if os.path.isdir(events_dir) else []:
        pid = int(name.rsplit("-", 1)[1].split(".")[0])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_torchrun(nproc: int, rep: int, s: Settings, root: str, fix: bool) -> Run:
    workdir = tempfile.mkdtemp(prefix=f"torchrun{nproc}-{rep}-", dir=root)
    events_dir = os.path.join(workdir, "events")
    victim = nproc // 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "-m",
        "resilient_comm.testing.toy",
        "--baseline",
        *s.toy_args(workdir),
        "--events",
        events_dir,
        "--kill",
        f"{victim}:{s.kill_step}:start",
    ]
    env = {**os.environ, **(FIX if fix else {})}
    for k in () if fix else FIX:
        env.pop(k, None)
    run = Run("torchrun" if fix else "torchrun-default", nproc, rep, False)
    with open(os.path.join(workdir, "torchrun.log"), "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(s.timeout_s)
            run.note = f"torchrun exit status {proc.returncode}"
            if proc.returncode:
                run.note += f" ({_root_cause(workdir)})"
            hung = False
        except subprocess.TimeoutExpired:
            _end(proc, events_dir)
            run.note = f"no recovery within {s.timeout_s:.0f} s: the restarted workers hung"
            hung = True
    events = read_events(events_dir)
    kill_t = next((e["t"] for e in events if e["event"] == "kill"), None)
    after = [e for e in events if e["event"] == "commit" and e.get("generation", 0) >= 1]
    if kill_t is None or not after:
        if not hung:
            run.note = f"no recovery: torchrun exited {proc.returncode} ({_last_error(workdir)})"
        return run
    run.recovered, run.fault_t = True, kill_t
    first = min(e["step"] for e in after)
    run.first_commit_s = max(e["t"] for e in after if e["step"] == first) - kill_t
    run.resume_step = first
    run.world_after = nproc
    last = max(e["step"] for e in events if e["event"] == "commit" and e.get("generation", 0) == 0)
    run.redone = last + 2 - first
    return run


def _last_error(workdir: str) -> str:
    """The last error a worker printed in torchrun's log (what the restarted workers hit)."""
    with open(os.path.join(workdir, "torchrun.log"), errors="replace") as f:
        errors = [line.strip() for line in f if re.match(r"(\[rank\d+\]: )?[A-Za-z]+Error: \S", line)]
    return errors[-1][:240] if errors else "no worker error in its log"


def _root_cause(workdir: str) -> str:
    """torchrun's "Root Cause" summary of a failed run, in one line."""
    with open(os.path.join(workdir, "torchrun.log"), errors="replace") as f:
        text = f.read()
    m = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)[^\n]*?(\(SIG\w+\))?\n", text, re.DOTALL)
    return (
        f"root cause: a worker's exit code {m.group(1)} {m.group(2) or ''}".strip() if m else "no root cause"
    )


def _stat(values: list[float | None]) -> tuple[float | None, float | None]:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None, None
    return statistics.median(v), v[min(len(v) - 1, max(0, -(-9 * len(v) // 10) - 1))]


def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f} ms" if unit == "ms" else f"{x:.3f} s"


def report(runs: list[Run]) -> tuple[str, list[str]]:
    """The table and the target verdicts."""
    head = (
        f"{'system':<18} {'ranks':>5} {'runs':>4} {'recovered':>9} | {'fault->first commit':>21} "
        f"{'p90':>9} | {'detected':>9} {'exit rep.':>9} {'hb susp.':>9} | {'redone':>6}"
    )
    lines = [head, "-" * len(head)]
    groups: dict[tuple[str, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.system, r.nproc), []).append(r)
    med: dict[tuple[str, int], float | None] = {}
    for (system, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        fc = _stat([r.first_commit_s for r in rs])
        med[(system, n)] = fc[0]
        redone = [r.redone for r in rs if r.redone is not None]
        lines.append(
            f"{system:<18} {n:>5} {len(rs):>4} {sum(r.recovered for r in rs):>9} | {_fmt(fc[0]):>21} {_fmt(fc[1]):>9} | "
            f"{_fmt(_stat([r.detected_s for r in rs])[0], 'ms'):>9} {_fmt(_stat([r.exit_report_s for r in rs])[0], 'ms'):>9} "
            f"{_fmt(_stat([r.suspicion_s for r in rs])[0], 'ms'):>9} | {max(redone) if redone else '-':>6}"
        )
    ours = [r for r in runs if r.system == "ours"]
    lines.append("")
    for system, n in sorted(
        {(r.system, r.nproc) for r in runs if r.system in ("ours", "ours-no-lock", "ours-spare")}
    ):
        rs = [r for r in runs if r.system == system and r.nproc == n and r.phases_ms]
        if rs:
            lines.append(
                f"{system}, {n} ranks, recovery phases (ms, median over runs of the survivors' median): "
                + ", ".join(
                    f"{p} {statistics.median(r.phases_ms.get(p, 0.0) for r in rs):.1f}"
                    for p in rs[0].phases_ms
                )
            )
    verdicts = []
    for n, bound in TARGETS.items():
        m = med.get(("ours", n))
        if ("ours", n) in med:
            verdicts.append(
                f"target: SIGKILL -> first committed step <= {bound} s median at {n} ranks: "
                f"{'MET' if m is not None and m <= bound else 'NOT MET'} ({_fmt(m)})"
            )
        t = med.get(("torchrun", n))
        if m is not None and ("torchrun", n) in med:
            ratio = None if t is None else t / m
            verdicts.append(
                f"target: >= 10x faster than torchrun restart at {n} ranks: "
                f"{'MET' if ratio is not None and ratio >= 10 else 'NOT MET'} "
                f"({'torchrun never recovered' if ratio is None else f'{ratio:.0f}x'})"
            )
    det = _stat([r.exit_report_s for r in ours])[0]
    if ours:
        verdicts.append(
            f"target: detection through the launcher <= 0.3 s median: "
            f"{'MET' if det is not None and det <= 0.3 else 'NOT MET'} ({_fmt(det, 'ms')})"
        )
    hb = _stat([r.suspicion_s for r in runs if r.system == "ours-sigstop"])[0]
    if any(r.system == "ours-sigstop" for r in runs):
        verdicts.append(
            f"target: detection through heartbeats alone <= 1.5 s median: "
            f"{'MET' if hb is not None and hb <= 1.5 else 'NOT MET'} ({_fmt(hb)})"
        )
    for n in sorted({r.nproc for r in runs if r.system == "ours-spare"}):
        rs = [r for r in runs if r.system == "ours-spare" and r.nproc == n]
        m = _stat([r.first_commit_s for r in rs])[0]
        kept = all(r.world_after == n for r in rs if r.recovered)
        verdicts.append(
            f"target: hot spare, SIGKILL -> first committed step with the world size restored <= "
            f"{SPARE_TARGET} s median at {n} ranks: "
            f"{'MET' if m is not None and m <= SPARE_TARGET and kept else 'NOT MET'} ({_fmt(m)}"
            f"{'' if kept else ', world size NOT kept'})"
        )
    for n in sorted({r.nproc for r in runs if r.system == "in-process-restart"}):
        m, base = med.get(("in-process-restart", n)), med.get(("max-restarts", n))
        if n in TARGETS:
            verdicts.append(
                f"target: in-process restart of the tutorial's script, SIGKILL -> first step <= "
                f"{INPROCESS_TARGET} s median at {n} ranks: "
                f"{'MET' if m is not None and m <= INPROCESS_TARGET else 'NOT MET'} ({_fmt(m)})"
            )
        if ("max-restarts", n) in med:
            ratio = None if m is None or base is None else base / m
            verdicts.append(
                f"target: in-process restart >= 5x faster than --max-restarts at {n} ranks: "
                f"{'MET' if ratio is not None and ratio >= 5 else 'NOT MET'} "
                f"({'-' if ratio is None else f'{ratio:.1f}x'})"
            )
    redone = [r.redone for r in ours if r.redone is not None]
    if redone:
        verdicts.append(
            f"target: <= 1 step redone (ours): {'MET' if max(redone) <= 1 else 'NOT MET'} (max {max(redone)})"
        )
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm bench recovery", description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", default="4,8", help="world sizes (default 4,8)")
    p.add_argument("--reps", type=int, default=10, help="repetitions per system and size (default 10)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--kill-step", type=int, default=25, help="the victim dies at the start of this step")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint cadence in steps, both systems")
    p.add_argument("--step-ms", type=float, default=0.0, help="extra time per step standing for compute")
    p.add_argument(
        "--sigstop-reps", type=int, default=5, help="heartbeat-only detection runs at the first size"
    )
    p.add_argument("--no-torchrun", action="store_true", help="no torchrun runs")
    p.add_argument(
        "--no-scripts",
        action="store_true",
        help="no runs of the tutorial's script (in-process-restart, max-restarts)",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="K",
        help="also runs with K hot spares (system ours-spare); with --spares-only, only those",
    )
    p.add_argument("--spares-only", action="store_true", help="only the hot-spare runs")
    p.add_argument(
        "--no-lock-baseline",
        action="store_true",
        help="also runs ours with RESILIENT_COMM_LIVENESS=0 (system ours-no-lock), interleaved",
    )
    p.add_argument("--features", type=int, default=16, help="toy model input width (default 16)")
    p.add_argument("--hidden", type=int, default=32, help="toy model hidden width (default 32)")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="toy model dtype")
    p.add_argument(
        "--torchrun-default",
        type=int,
        default=0,
        metavar="N",
        help="also N runs per size of torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="bound on one run, seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="write every run and the machine here")
    a = p.parse_args(argv)
    nprocs = [int(x) for x in a.nprocs.split(",")]
    logging.getLogger("resilient_comm.launcher").setLevel(logging.ERROR)  # exits are expected here
    if a.spares_only and not a.spares:
        p.error("--spares-only needs --spares K")
    s = Settings(a.steps, a.kill_step, a.ckpt_every, a.step_ms, a.timeout, a.features, a.hidden, a.dtype)
    runs: list[Run] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as root:
        for n in nprocs:
            for rep in range(a.reps):
                order = ["ours", "torchrun"] if rep % 2 == 0 else ["torchrun", "ours"]
                if not a.no_scripts:
                    scripts = ["in-process-restart", "max-restarts"]
                    order += scripts if rep % 2 == 0 else scripts[::-1]
                if a.spares:
                    order = ["ours-spare"] if a.spares_only else [*order, "ours-spare"]
                if a.no_lock_baseline:
                    order.insert(rep % 2, "ours-no-lock")
                for system in order:
                    if system == "ours":
                        runs.append(run_ours(n, rep, s, root))
                    elif system == "ours-no-lock":
                        runs.append(run_ours(n, rep, s, root, lock=False))
                    elif system == "ours-spare":
                        runs.append(run_ours(n, rep, s, root, spares=a.spares))
                    elif system in ("in-process-restart", "max-restarts"):
                        runs.append(run_script(n, rep, s, root, system))
                    elif not a.no_torchrun:
                        runs.append(run_torchrun(n, rep, s, root, fix=True))
                    r = runs[-1]
                    print(
                        f"  {r.system:<18} {n} ranks rep {rep}: fault->first commit {_fmt(r.first_commit_s)}"
                        f"  {r.note}",
                        flush=True,
                    )
            for rep in range(a.torchrun_default):
                runs.append(run_torchrun(n, rep, s, root, fix=False))
                print(
                    f"  torchrun-default {n} ranks rep {rep}: {_fmt(runs[-1].first_commit_s)}  {runs[-1].note}",
                    flush=True,
                )
        for rep in range(0 if a.spares_only else a.sigstop_reps):
            runs.append(run_ours(nprocs[0], rep, s, root, sigstop=True))
            print(
                f"  ours-sigstop     {nprocs[0]} ranks rep {rep}: stop->suspicion {_fmt(runs[-1].suspicion_s)}",
                flush=True,
            )
    table, verdicts = report(runs)
    print()
    print(
        f"SIGKILL -> first committed step ({a.reps} reps; steps {a.steps}, kill at step {a.kill_step}, "
        f"checkpoint every {a.ckpt_every}; model {s.params / 1e6:.1f}M parameters, {s.dtype}; "
        f"{time.time() - started:.0f} s)"
    )
    print(table)
    print()
    print("\n".join(verdicts))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "argv": argv,
                    "settings": asdict(s),
                    "machine": machine(),
                    "runs": [asdict(r) for r in runs],
                    "verdicts": verdicts,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
