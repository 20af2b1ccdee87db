"""A small deterministic training program: the worker of the demo, the recovery benchmark
and the elastic tests.

    resilient-run --nproc-per-node 4 -m resilient_comm.testing.toy --steps 60 --kill 2:20:start
    torchrun --nproc-per-node 4 --max-restarts 1 -m resilient_comm.testing.toy --baseline ...

The model is a two-layer MLP in float64 (``--dtype``) (tensor parallel when ``--tp`` > 1: the hidden layer
is split across the TP group and the output's partial sums are all-reduced), trained by SGD
with momentum on synthetic data. The data of step s for data stream d is drawn from a
generator seeded by (seed, s, d), so a run is bit-for-bit repeatable and each data-parallel
replica keeps its own stream (d: its launch replica, or ``--data-ids``) across a shrink.

Modes:

- **elastic** (default): under ``resilient-run``, with `resilient_comm.elastic.Controller`.
- **--baseline**: plain ``torch.distributed`` on gloo (``env://``), checkpoint every
  ``--ckpt-every`` steps and resume from it at start: the torchrun elastic-restart job.

Under ``resilient-run --spares K`` the same program runs as a hot spare: it builds its model
up front (so it waits warm), and once placed takes over the data stream of the rank it
replaced (`Controller.slot`). ``--digest`` adds a hash of the state to the ``restored`` event
every member writes after a recovery (a spare's state must equal its donor's, bit for bit).

Fault injection, all by the worker itself with a real signal: ``--kill RANK:STEP:PHASE``
SIGKILLs rank RANK at step STEP's PHASE (start, synced, committed), or at its first recovery's
PHASE (joined, agreed) when STEP is the epoch; in baseline mode only the first generation
kills. ``--mark RANK:STEP`` sets store key ``toy/at/RANK/STEP`` when RANK starts STEP (for
tests that stop a worker from outside); ``--hold RANK:STEP`` also makes RANK wait there for
key ``toy/go/STEP`` (tests act on the job while it cannot finish). ``--events DIR`` appends JSON lines (kill, commit,
recovery, resume, done) to ``DIR/events-RANK-PID.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TextIO

import torch
import torch.distributed as dist

PHASES = ("start", "synced", "committed", "joined", "agreed")


class _TPSum(torch.autograd.Function):
    """Sum partial outputs over the TP group; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TinyMLP(torch.nn.Module):
    """Two layers, the hidden one split across the TP group. Like batch norm's
    ``num_batches_tracked``, a buffer counts the batches seen in forward (and anneals the
    input scale with it): a step whose forward ran but which was not committed must be rolled
    back, or the count would run ahead."""

    tracked: torch.Tensor

    def __init__(
        self,
        seed: int,
        features: int,
        hidden: int,
        tp: int,
        tp_index: int,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        cut = slice(tp_index * hidden // tp, (tp_index + 1) * hidden // tp)
        w1 = torch.randn(hidden, features, generator=g, dtype=dtype)[cut] * 0.3
        w2 = torch.randn(4, hidden, generator=g, dtype=dtype)[:, cut] * 0.3
        self.w1 = torch.nn.Parameter(w1.contiguous())
        self.b1 = torch.nn.Parameter(torch.zeros(hidden // tp, dtype=dtype))
        self.w2 = torch.nn.Parameter(w2.contiguous())
        self.b2 = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        self.dtype = dtype
        self.register_buffer("tracked", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
        self.tracked.add_(1)
        x = x / (1.0 + 0.01 * self.tracked.to(self.dtype).sqrt())
        part = torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T
        return (_TPSum.apply(part, tp_group) if tp_group is not None else part) + self.b2


class Trainer:
    """Model, optimizer and data; `state_dict`/`load_state_dict` cover model and optimizer,
    both the same on every dp replica (`replicated_state_dict`: all of it)."""

    def __init__(
        self,
        seed: int,
        features: int,
        hidden: int,
        tp: int,
        tp_index: int,
        batch: int,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.model = TinyMLP(seed, features, hidden, tp, tp_index, dtype)
        self.dtype = dtype
        self.w_true = torch.randn(features, 4, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.seed, self.features, self.batch = seed, features, batch
        self.per_rank: torch.Tensor | None = None  # a value that differs per rank (``--per-rank-marked``)

    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params()]  # type: ignore[misc]

    def forward_backward(self, step: int, data_id: int, tp_group: dist.ProcessGroup | None) -> float:
        self.opt.zero_grad(set_to_none=False)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7919 + data_id)
        x = torch.randn(self.batch, self.features, generator=g, dtype=self.dtype)
        loss = torch.nn.functional.mse_loss(self.model(x, tp_group), torch.sin(x @ self.w_true))
        loss.backward()
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        sd = {"model": self.model.state_dict(), "opt": self.opt.state_dict()}
        return sd if self.per_rank is None else {**sd, "per_rank": self.per_rank.clone()}

    def replicated_state_dict(self) -> dict[str, Any]:
        return self.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])
        if self.per_rank is not None:
            self.per_rank = sd["per_rank"].clone()


class Events:
    """JSON lines, one file per process; line-buffered, so a line written before a SIGKILL is
    already the kernel's."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self._f: TextIO | None = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"events-{rank}-{os.getpid()}.jsonl")
            self._f = open(path, "a", buffering=1)  # noqa: SIM115  (open for the process's life)
        self.rank = rank

    def write(self, event: str, **fields: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"event": event, "rank": self.rank, "t": time.time(), **fields}) + "\n")


def _faults(specs: list[str], rank: int) -> dict[tuple[str, int], bool]:
    out = {}
    for spec in specs:
        r, step, phase = spec.split(":")
        if phase not in PHASES:
            raise SystemExit(f"--kill {spec}: phase must be one of {PHASES}")
        if int(r) == rank:
            out[(phase, int(step))] = True
    return out


def _save(path: str, step: int, trainer: Trainer) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"step": step, "state": trainer.state_dict()}, tmp)
    os.replace(tmp, path)


def _load(path: str | None, trainer: Trainer) -> int:
    """Load {step, state} from `path` if it exists; returns the step to start from."""
    if not path or not os.path.exists(path):
        return 0
    saved = torch.load(path, weights_only=False)
    trainer.load_state_dict(saved["state"])
    return int(saved["step"]) + 1


def _die(events: Events, why: str, step: int) -> None:
    events.write("kill", why=why, step=step)
    os.kill(os.getpid(), signal.SIGKILL)


def _burn(cpu_s: float) -> None:
    """Compute that needs the CPU (a sleep does not): `cpu_s` of this thread's CPU time, in
    short slices, so that a CPU quota or a busier core slows it as it would a real step."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        sum(range(2_000))


def _flip_a_bit(trainer: Trainer, events: Events, step: int) -> None:
    """Silent data corruption, as a cosmic ray or a bad DIMM would leave it: one bit of one
    parameter's memory, changed in place (a mantissa bit of the first weight)."""
    with torch.no_grad():
        raw = trainer.model.w1.data.view(-1).view(torch.uint8)
        raw[2] ^= 0x10
    events.write("flip", step=step)


def train_or_leave(events: Events, rank: int, train: Callable[[], Any]) -> bool:
    """train(), the controller's loop; False where the job cannot go on (`RecoveryError`). A
    worker that left the job (`Evicted`: its replica evicted, or a slow rank handing its place
    to a spare) exits at once, without the interpreter's teardown: with torch loaded that is
    ~1 s of CPU in the garbage collector (measured), taken from the members still training on
    a shared machine, and 10 s of it for a rank held at a tenth of a core."""
    from resilient_comm.elastic import EXIT_EVICTED, Evicted, RecoveryError

    try:
        train()
    except Evicted as e:
        events.write("evicted", why=str(e))
        print(f"rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_EVICTED)
    except RecoveryError as e:
        events.write("failed", why=str(e))
        print(f"rank {rank}: cannot recover: {e}", file=sys.stderr, flush=True)
        return False
    return True


def run_elastic(a: argparse.Namespace) -> int:
    from resilient_comm.elastic import Controller, Mesh
    from resilient_comm.elastic.model.env import ENV_SPARE
    from resilient_comm.elastic.model.pace import PaceConfig
    from resilient_comm.elastic.state.transfer import digest

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spare = os.environ.get(ENV_SPARE) == "1"
    events = Events(a.events, rank)
    if spare:
        events.write("spare", pid=os.getpid())
    kills = _faults(a.kill, rank)
    marks = {int(s.split(":")[1]) for s in a.mark if int(s.split(":")[0]) == rank}
    slow_speed, slow_from = 1.0, 1 << 62
    if a.slow and int(a.slow.split(":")[0]) == rank:  # RANK:SPEED:STEP
        slow_speed, slow_from = float(a.slow.split(":")[1]), int(a.slow.split(":")[2])
    holds = {int(s.split(":")[1]) for s in a.hold if int(s.split(":")[0]) == rank}
    flips = {int(s.split(":")[1]) for s in a.flip if int(s.split(":")[0]) == rank}
    flip_now = threading.Event()
    if a.flip_on_signal:
        signal.signal(signal.SIGUSR1, lambda *_: flip_now.set())
    mesh0 = Mesh.for_world(world, a.tp)
    data_ids = [int(d) for d in a.data_ids.split(",")] if a.data_ids else list(range(mesh0.dp))
    # A spare's tp index (and so its initial weights) is unknown until it is placed; the state
    # it receives then overwrites them, so any shard of the right shape will do.
    trainer = Trainer(
        a.seed,
        a.features,
        a.hidden,
        a.tp,
        0 if spare else mesh0.coords(rank)["tp"],
        a.batch,
        getattr(torch, a.dtype),
    )
    if a.per_rank_marked:
        trainer.per_rank = torch.tensor([rank])
    start = _load(a.resume_from, trainer) if a.resume_from else _load(a.ckpt, trainer)
    if start and not a.resume_from:
        events.write("resume", step=start)
    trace: dict[int, Any] = {}
    store = None
    if marks or holds:
        from resilient_comm.elastic.membership.protocol import connect

        store = connect(os.environ["RESILIENT_COMM_STORE"], datetime.timedelta(seconds=60))

    def hook(event: str, info: dict[str, Any]) -> None:
        phase = event.split(".")[1]
        key = (phase, info.get("epoch", info.get("step", -1)))
        if kills.pop(key, False):
            _die(events, f"{phase} of {'epoch' if event.startswith('recovery') else 'step'} {key[1]}", key[1])
        if event == "step.start" and info["step"] in marks and store is not None:
            store.set(f"toy/at/{rank}/{info['step']}", "1")
        if event == "step.start" and holds and info["step"] in holds and store is not None:
            holds.discard(info["step"])
            store.set(f"toy/held/{rank}/{info['step']}", "1")
            store.wait([f"toy/go/{info['step']}"])
        if event == "step.start" and a.log_starts:
            events.write("begin", step=info["step"])
        if event == "step.committed":
            events.write("commit", step=info["step"])
            if info["step"] in flips:  # once: the redone step after a roll back does not flip again
                flips.discard(info["step"])
                _flip_a_bit(trainer, events, info["step"])
        if event == "step.start" and flip_now.is_set():
            flip_now.clear()
            _flip_a_bit(trainer, events, info["step"])
        if event == "pace.window":
            events.write(
                "pace",
                step=info["step"],
                speeds={str(r): round(x, 3) for r, x in info["speeds"].items()},
                links={str(n): round(x, 3) for n, x in info["links"].items()},
            )
        if event == "pace.slow_link":
            events.write(
                "slow_link",
                step=info["step"],
                slow={str(n): round(x, 3) for n, x in info["slow"].items()},
                cleared=info["cleared"],
            )
        if event == "pace.slow":
            events.write(
                "slow", step=info["step"], slow=list(info["slow"]), leave=info["leave"], why=info["why"]
            )
        if event == "recovery.aborted":  # inside a recovery: it waits for the decision now
            events.write("aborted")
        if event == "integrity.agreed":
            events.write("agreed", step=info["step"], ms=info["ms"])
        if event == "integrity.mismatch":
            events.write(
                "mismatch",
                step=info["step"],
                back_to=info["back_to"],
                diverged=info["diverged"],
                keys=info["keys"],
            )
        if event == "recovery.restored":
            extra = {"digest": digest(trainer.state_dict())} if a.digest else {}
            events.write(
                "restored",
                epoch=info["epoch"],
                step=info["step"],
                members=info["members"],
                place=info["place"].rank,
                slot=info["place"].slot,
                **extra,
            )

    nbytes = sum(p.numel() * p.element_size() for p in trainer.params())

    def burn_then_state(place: Any) -> Any:
        """A state factory that costs CPU the way a first `import torch.optim` does: in long C
        calls that hold the GIL (the heartbeat thread waits for each), here ~0.5 s apiece."""
        end = time.process_time() + a.startup_burn_ms / 1e3
        while time.process_time() < end:
            sum(range(25_000_000))  # one C call: the GIL is not released until it returns
        return trainer

    def warm_up() -> None:
        """What a factory's first use would cost, paid before this process waits or trains."""
        end = time.process_time() + a.warmup_burn_ms / 1e3
        while time.process_time() < end:
            sum(range(25_000_000))
        events.write("warm", spare=spare)

    ctl = Controller(
        burn_then_state if a.startup_burn_ms else trainer,
        tp=a.tp,
        backend=a.backend,
        start_step=start,
        comm_bytes=nbytes,
        hook=hook,
        checkpoint_dir=a.ckpt_dir,
        checkpoint_every=a.ckpt_dir_every,
        warmup=warm_up if a.warmup_burn_ms else None,
        fingerprint_every=a.fingerprint_every,
        pace=PaceConfig(
            window=a.pace_window, slow_below=a.pace_slow_below, clear_above=max(0.95, a.pace_slow_below)
        )
        if a.pace_window is not None
        else None,
    )

    def train_step(s: Any) -> None:
        # The tensor-parallel group as torchtitan-style code takes it: from the controller's
        # DeviceMesh, which every recovery replaces (the old groups are gone by then).
        tp_group = ctl.device_mesh["tp"].get_group() if a.tp > 1 else None
        cpu0 = time.thread_time()
        trainer.forward_backward(s.step, data_ids[mesh0.replica_of(ctl.slot)], tp_group)
        if a.step_ms:
            time.sleep(a.step_ms / 1e3)  # stands for a longer computation
        if a.burn_ms:
            _burn(a.burn_ms / 1e3)
        if s.step >= slow_from:  # its step's CPU work made 1/speed of its peers'
            _burn((time.thread_time() - cpu0) * (1.0 / slow_speed - 1.0))
        s.commit(trainer.opt.step, grads=trainer.grads())
        if a.trace and ctl.members[0] == rank:
            trace[s.step] = {"step": s.step, "state": copy.deepcopy(trainer.state_dict())}
        if a.ckpt and a.ckpt_every and (s.step + 1) % a.ckpt_every == 0 and ctl.members[0] == rank:
            _save(a.ckpt, s.step, trainer)

    if not train_or_leave(events, rank, lambda: ctl.run(a.steps, train_step)):
        return 1
    for tl in ctl.recoveries:
        events.write("recovery", timeline=tl.as_dict())
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        try:
            dm = ctl.device_mesh
            mesh_dims = dict(zip(dm.mesh_dim_names or (), dm.shape))
            mesh_dims["tp_is_ctl_group"] = int(dm["tp"].get_group() is ctl.groups.tp)
        except RuntimeError:  # never a member (a spare that was not placed)
            mesh_dims = {}
        torch.save(
            {
                "state": trainer.state_dict(),
                "members": ctl.members,
                "committed": ctl.committed,
                "recoveries": [tl.as_dict() for tl in ctl.recoveries],
                "device_mesh": mesh_dims,
            },
            os.path.join(a.dump, f"final-{rank}.pt"),
        )
    if trace:
        torch.save(trace, a.trace)
    if a.backend == "resilient_nccl" and os.environ.get("RESILIENT_COMM_NCCL_EMULATE") == "1":
        from resilient_comm import _C

        events.write("nccl_emulator", stats=_C.nccl_emulator_stats())  # evidence of the NCCL code path
    events.write("done", committed=ctl.committed, members=ctl.members)
    ctl.close()
    return 0


def run_baseline(a: argparse.Namespace) -> int:
    rank = int(os.environ["RANK"])
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Events(a.events, rank)
    kills = _faults(a.kill, rank) if generation == 0 else {}
    events.write("launched", generation=generation)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    trainer = Trainer(a.seed, a.features, a.hidden, 1, 0, a.batch)
    start = _load(a.ckpt, trainer)
    if start:
        events.write("resume", step=start, generation=generation)
    for step in range(start, a.steps):
        if kills.pop(("start", step), False):
            _die(events, f"start of step {step}", step)
        trainer.forward_backward(step, rank, None)
        if a.step_ms:
            time.sleep(a.step_ms / 1e3)
        grads = trainer.grads()
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world
        for t, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            t.copy_(r)
        trainer.opt.step()
        events.write("commit", step=step, generation=generation)
        if a.ckpt and a.ckpt_every and (step + 1) % a.ckpt_every == 0 and rank == 0:
            _save(a.ckpt, step, trainer)
    events.write("done", committed=a.steps - 1, generation=generation)
    dist.destroy_process_group()
    return 0


class ToyJob:
    """The parent's side: the toy on `nproc` workers under an in-process `Launcher` (whose
    store and worker pids the caller can use), in `workdir` (events, dumps, and with `quiet`
    the workers' output in logs/)."""

    def __init__(
        self, nproc: int, args: list[str], workdir: str, quiet: bool = False, **launcher: Any
    ) -> None:
        from resilient_comm.elastic.node.launcher import Launcher

        self.workdir = workdir
        self.events_dir = os.path.join(workdir, "events")
        cmd = [sys.executable, "-m", "resilient_comm.testing.toy", "--events", self.events_dir, *args]
        self.launcher = Launcher(
            cmd, nproc, log_dir=os.path.join(workdir, "logs") if quiet else None, **launcher
        )
        self.status: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ToyJob:
        self.launcher.start()

        def watch() -> None:
            self.status = self.launcher.wait()

        self._thread = threading.Thread(target=watch, name="toy-launcher", daemon=True)
        self._thread.start()
        return self

    def pid(self, rank: int) -> int:
        return self.launcher.workers[rank].proc.pid

    def wait(self, timeout_s: float) -> int:
        """The launcher's exit status once every worker ended; kills them past `timeout_s`."""
        assert self._thread is not None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.launcher.forward(signal.SIGKILL)
            self._thread.join()
            raise TimeoutError(f"the toy job did not finish within {timeout_s} s")
        assert self.status is not None
        return self.status

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.events_dir)


def read_events(directory: str) -> list[dict[str, Any]]:
    """Every event written under `directory` (by every worker of every generation), by time."""
    out: list[dict[str, Any]] = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name)) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return sorted(out, key=lambda e: e["t"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m resilient_comm.testing.toy", description=__doc__.splitlines()[0]
    )
    p.add_argument("--steps", type=int, default=60, help="steps to train (default 60)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (elastic mode)")
    p.add_argument(
        "--backend",
        default="resilient_tcp",
        choices=("resilient_tcp", "resilient_nccl"),
        help="elastic mode's backend (resilient_nccl on CPU tensors: with RESILIENT_COMM_NCCL_EMULATE=1 "
        "the NCCL code path on the NCCL emulator)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="samples per replica and step")
    p.add_argument("--step-ms", type=float, default=0.0, help="extra time per step standing for compute")
    p.add_argument("--burn-ms", type=float, default=0.0, help="extra CPU time per step standing for compute")
    p.add_argument(
        "--warmup-burn-ms",
        type=float,
        default=0.0,
        help="elastic: a Controller warmup= that burns this much CPU (a spare: before it waits)",
    )
    p.add_argument(
        "--startup-burn-ms",
        type=float,
        default=0.0,
        help="elastic: CPU the state factory burns (a first import's cost) before step 0",
    )
    p.add_argument("--kill", action="append", default=[], metavar="RANK:STEP:PHASE", help="self-SIGKILL")
    p.add_argument(
        "--slow",
        metavar="RANK:SPEED:STEP",
        help="from STEP on, RANK's CPU work per step is 1/SPEED of its peers' (it burns the rest): a rank at a "
        "precise speed (a CPU quota's effect depends on the machine's load)",
    )
    p.add_argument(
        "--mark", action="append", default=[], metavar="RANK:STEP", help="store key at a step's start"
    )
    p.add_argument(
        "--hold",
        action="append",
        default=[],
        metavar="RANK:STEP",
        help="at STEP's start RANK sets toy/held/RANK/STEP and waits for store key toy/go/STEP",
    )
    p.add_argument("--events", default=None, metavar="DIR", help="append JSON-line events here")
    p.add_argument(
        "--ckpt", default=None, help="checkpoint file (written every --ckpt-every steps, read at start)"
    )
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument(
        "--dump", default=None, metavar="DIR", help="elastic: final state per rank (final-RANK.pt)"
    )
    p.add_argument(
        "--trace", default=None, metavar="FILE", help="elastic: every committed state (lowest member)"
    )
    p.add_argument(
        "--resume-from", default=None, metavar="FILE", help="elastic: start from this {step, state}"
    )
    p.add_argument("--data-ids", default=None, help="elastic: data stream of each replica, comma-separated")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="model dtype")
    p.add_argument("--log-starts", action="store_true", help="elastic: a 'begin' event at each step's start")
    p.add_argument("--digest", action="store_true", help="elastic: state hash in each 'restored' event")
    p.add_argument("--ckpt-dir", default=None, help="elastic: the controller's async checkpoints go here")
    p.add_argument("--ckpt-dir-every", type=int, default=0, help="elastic: async checkpoint every N steps")
    p.add_argument(
        "--flip",
        action="append",
        default=[],
        metavar="RANK:STEP",
        help="elastic: flip a bit of RANK's parameters after STEP's commit (silent data corruption)",
    )
    p.add_argument(
        "--flip-on-signal", action="store_true", help="elastic: flip a bit at the next step after SIGUSR1"
    )
    p.add_argument(
        "--per-rank-marked",
        action="store_true",
        help="elastic: the state holds a value that differs per rank, marked replicated (a user's mistake)",
    )
    p.add_argument(
        "--fingerprint-every",
        type=int,
        default=None,
        help="elastic: compare the replicas' state every N steps (default: RESILIENT_COMM_FINGERPRINT_EVERY)",
    )
    p.add_argument(
        "--pace-window",
        type=int,
        default=None,
        help="elastic: fail-slow detection's window in steps (default: RESILIENT_COMM_PACE_WINDOW)",
    )
    p.add_argument(
        "--pace-slow-below",
        type=float,
        default=0.9,
        help="elastic: with --pace-window, slow under this speed",
    )
    p.add_argument("--baseline", action="store_true", help="plain gloo with checkpoint/restart (torchrun)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"[rank {os.environ.get('RANK', '?')}] %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("resilient_comm.elastic").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's all_gather_into_tensor rename
    return run_baseline(a) if a.baseline else run_elastic(a)


if __name__ == "__main__":
    sys.exit(main())
