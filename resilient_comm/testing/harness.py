"""Start N worker processes that share a TCPStore hosted by the caller.

Workers are forked from a fork server that has already imported torch and resilient_comm
(``forkserver`` with a preload: a fresh process per worker, never a fork of the caller, which
runs threads, and without each worker paying the ~1.3 s import of torch again). A worker gets
the caller's environment as it is when the worker starts, not the server's. Each runs ``fn(ctx, *args)`` where ``ctx`` gives its rank, the world size and the
shared store; the return value (picklable) or the exception text comes back to the caller.
The caller can also wait on store keys a worker sets, and kill or stop workers, which is how
fault tests place a SIGKILL at a precise point without sleeping.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any, Self

import torch.distributed as dist

from resilient_comm import _C


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    host: str
    port: int
    timeout_s: float

    def store(self) -> dist.TCPStore:
        return dist.TCPStore(
            self.host, self.port, self.world_size, False, timeout=datetime.timedelta(seconds=self.timeout_s)
        )

    def init(self, backend: str = "resilient_tcp", timeout_s: float | None = None) -> None:
        """init_process_group on the shared store."""
        import resilient_comm  # noqa: F401  (registers the backends)

        dist.init_process_group(
            backend,
            store=self.store(),
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s or self.timeout_s),
        )


@dataclass
class WorkerResult:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    exitcode: int | None = None
    elapsed_s: float = 0.0


# Imported once by the fork server, before it forks any worker.
_PRELOAD = ["torch", "torch.distributed", "resilient_comm", "resilient_comm.testing.harness"]


def _context() -> Any:
    """The fork-server context (its server starts with the first worker and lives as long as
    the caller). RESILIENT_COMM_TEST_START=spawn starts each worker from scratch instead."""
    if os.environ.get("RESILIENT_COMM_TEST_START", "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(fn: Callable[..., Any], ctx: WorkerContext, args: tuple, conn: Any, env: dict[str, str]) -> None:
    start = time.monotonic()
    # The fork server's environment is the caller's when it started; the worker's is the
    # caller's now (a test sets knobs such as RESILIENT_COMM_SHM before it starts workers).
    os.environ.clear()
    os.environ.update(env)
    try:
        value = fn(ctx, *args)
        conn.send(WorkerResult(ctx.rank, True, value=value, elapsed_s=time.monotonic() - start))
    except BaseException as e:
        text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        conn.send(WorkerResult(ctx.rank, False, error=text, elapsed_s=time.monotonic() - start))
    finally:
        conn.close()
        # Skip interpreter teardown: a process group left with pending work must not make a
        # finished worker linger. A normal end, though: its peers must not see a death
        # ([Note: the liveness lock]).
        _C.liveness_release()
        os._exit(0)


@dataclass
class Workers:
    """A running set of workers. Use as a context manager; leftover workers are killed."""

    world_size: int
    timeout_s: float
    store: dist.TCPStore
    procs: list[Any] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)

    def wait_key(self, key: str, timeout_s: float | None = None) -> None:
        self.store.wait([key], datetime.timedelta(seconds=timeout_s or self.timeout_s))

    def wait_ranks(
        self, prefix: str, ranks: Iterable[int] | None = None, timeout_s: float | None = None
    ) -> None:
        """Wait until every rank in `ranks` (default: all) has set `{prefix}/{rank}`."""
        keys = [f"{prefix}/{r}" for r in (range(self.world_size) if ranks is None else ranks)]
        self.store.wait(keys, datetime.timedelta(seconds=timeout_s or self.timeout_s))

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[rank].pid, sig)

    def join(self, timeout_s: float | None = None) -> list[WorkerResult]:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: list[WorkerResult] = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns)):
            left = max(0.0, deadline - time.monotonic())
            res: WorkerResult | None = None
            if conn.poll(left):
                try:
                    res = conn.recv()
                except EOFError:
                    res = None
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
                res = res or WorkerResult(
                    rank, False, error="worker did not finish before the harness timeout"
                )
            if res is None:
                res = WorkerResult(rank, False, error=f"worker exited with code {p.exitcode} and no result")
            res.exitcode = p.exitcode
            results.append(res)
        return results

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def same_state(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two (nested) states: tensors by dtype and value."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
        )
    return bool(a == b)


def start_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> Workers:
    """Start `world_size` workers running fn(ctx, *args); returns at once."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    ctx_mp = _context()
    w = Workers(world_size, timeout_s, store)
    env = dict(os.environ)
    for rank in range(world_size):
        parent, child = ctx_mp.Pipe(duplex=False)
        ctx = WorkerContext(rank, world_size, "127.0.0.1", store.port, timeout_s)
        p = ctx_mp.Process(target=_entry, args=(fn, ctx, args, child, env), daemon=True)
        p.start()
        child.close()
        w.procs.append(p)
        w.conns.append(parent)
    return w


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0
) -> list[WorkerResult]:
    """Run fn(ctx, *args) on `world_size` workers and return their results, by rank."""
    with start_workers(fn, world_size, *args, timeout_s=timeout_s) as w:
        return w.join()


def all_reduce_until_failure(
    store: dist.Store,
    rank: int,
    numel: int,
    announce_after: int = 10,
    on_announce: Callable[[], None] | None = None,
    catch: tuple[type[BaseException], ...] = (dist.DistBackendError,),
) -> tuple[str, float]:
    """In a worker: all-reduces ones (SUM) until an op raises one of `catch`; after
    `announce_after` ops it runs `on_announce` and sets ``looping/{rank}`` in `store`, the key a
    fault test waits for before it strikes. Returns the error as "Type: message" and the
    time.time() at which it was raised."""
    import torch

    t = torch.ones(numel)
    i = 0
    try:
        while True:
            dist.all_reduce(t)
            t.fill_(1.0)
            i += 1
            if i == announce_after:
                if on_announce is not None:
                    on_announce()
                store.set(f"looping/{rank}", "1")
    except catch as e:
        return f"{type(e).__name__}: {e}", time.time()


def end_all(procs: Iterable[subprocess.Popen], files: Iterable[IO[Any]] = ()) -> None:
    """A test's cleanup: kill and reap whichever of `procs` still run, then close `files`."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for f in files:
        f.close()


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = 60.0) -> None:
    """Bounded wait for a condition a job makes true (store keys, registrations); TimeoutError
    naming `what` past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(delay)  # pacing of the poll, not a synchronisation: the condition ends it
        delay = min(0.1, delay * 2)
