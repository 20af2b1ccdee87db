"""The data-parallel job of `resilient-comm bench compare`, written once per stack.

Every stack trains the same model on the same data with the same step time; only the loop
around the step differs, and each is written the way its own documentation says:

- ``torchrun``: ``init_process_group("gloo")`` from torchrun's environment, load the last
  checkpoint if there is one, checkpoint every ``--ckpt-every`` steps (rank 0 writes, then
  a barrier): the seed tutorial's restart-from-checkpoint recipe.
- ``reconfigure``: torch's own API (torch >= 2.14): ``init_process_group(backend,
  enable_reconfigure=True)``, handles exchanged through the job's store, then
  ``dist._reconfigure(uuid, handles).wait()``. Who is left is the user's to find out: here
  the bench's launcher (which sees its children exit, as torchrun's agent does) writes the
  dead ranks to the store (`dead_key`). A survivor that catches the error waits for that
  notice, takes a new handle and reconfigures with the survivors; the survivors then agree on
  the step (a rank whose all_reduce finished before the failure rolls its last update back).
- ``torchft``: one replica group per process (torchft's DDP example: "for DDP we can use
  replica groups of size 1"), its `Manager`, `DistributedDataParallel` and `Optimizer` over
  its `ProcessGroupGloo`; the bench starts the `torchft_lighthouse` command. A step whose all_reduce failed is
  not committed; the next quorum leaves the dead replica out. With ``--backend resilient_tcp``
  the Manager gets a native torch ProcessGroup on our backend instead (`_native_group`).
- ``ours``: the elastic `Controller` under ``resilient-run`` (docs/elastic.md's loop).

Each rank appends JSON lines to ``<events>/<rank>-<pid>.jsonl``: ``start`` (its pid),
``commit`` (step, wall time, world size) after every committed step, ``final`` (a digest of
its parameters) at the end. The bench reads them; nothing here measures anything.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

FEATURES, HIDDEN, BATCH = 32, 64, 16


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    ).double()


def batch(step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of one data-parallel slot at one step: the same on every stack."""
    g = torch.Generator().manual_seed(step * 100_003 + slot)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).tanh()


def loss_of(m: torch.nn.Module, step: int, slot: int, step_ms: float) -> torch.Tensor:
    time.sleep(step_ms / 1e3)  # stands for the step's compute
    x, y = batch(step, slot)
    return torch.nn.functional.mse_loss(m(x), y)


def _grads(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in m.parameters() if p.grad is not None]


def digest(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Events:
    def __init__(self, root: str, rank: int, **start: Any) -> None:
        os.makedirs(root, exist_ok=True)
        self._f = open(os.path.join(root, f"{rank}-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115 (for the process)
        self.rank = rank
        self.emit("start", pid=os.getpid(), **start)

    def emit(self, event: str, **info: Any) -> None:
        self._f.write(json.dumps({"event": event, "rank": self.rank, "t": time.time(), **info}) + "\n")


class Stop:
    """The last step, set by the bench once every survivor trained after the recovery (a file
    holding a step number): every stack runs until then, however long its recovery took."""

    def __init__(self, path: str, cap: int) -> None:
        self._path, self._last = path, cap - 1

    def reached(self, step: int) -> bool:
        if self._path and os.path.exists(self._path):
            with open(self._path) as f:
                text = f.read().strip()
            if text:
                self._last, self._path = int(text), ""
        return step > self._last


def dead_key(deaths: int) -> str:
    """The job store's key that the bench's launcher sets when the `deaths`-th rank exits with an
    error; its value lists every rank dead so far. Numbered by deaths, not by reconfiguration:
    a survivor that knows of k dead ranks waits on key k + 1, whichever reconfiguration it is at."""
    return f"dead/{deaths}"


def dead_ranks(store: dist.Store, deaths: int, timeout: datetime.timedelta) -> set[int]:
    """Every dead rank, once the launcher has reported `deaths` of them (raises on `timeout`)."""
    key = dead_key(deaths)
    store.wait([key], timeout)
    return {int(r) for r in store.get(key).decode().split(",")}


def _average(grads: list[torch.Tensor], world: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def run_torchrun(a: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ev = Events(a.events, rank, generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    step, stop = 0, Stop(a.stop_file, a.steps)
    if os.path.exists(a.ckpt):
        ckpt = torch.load(a.ckpt)
        m.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        step = ckpt["step"] + 1
    while not stop.reached(step):
        opt.zero_grad()
        loss_of(m, step, rank, a.step_ms).backward()
        _average(_grads(m), world)
        opt.step()
        ev.emit("commit", step=step, world=world)
        if (step + 1) % a.ckpt_every == 0 and rank == 0:
            torch.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": step}, a.ckpt + ".tmp")
            os.replace(a.ckpt + ".tmp", a.ckpt)
        if (step + 1) % a.ckpt_every == 0:
            dist.barrier()
        step += 1
    ev.emit("final", digest=digest(m))
    dist.destroy_process_group()


def run_reconfigure(a: argparse.Namespace) -> None:
    import resilient_comm  # noqa: F401  (registers our backends)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    kw = {"timeout": datetime.timedelta(seconds=a.timeout)} if a.timeout else {}
    dist.init_process_group(
        a.backend, store=store, rank=rank, world_size=world, enable_reconfigure=True, **kw
    )
    ev = Events(a.events, rank)
    members, uuid = list(range(world)), 1

    def reconfigure() -> None:
        store.set(f"handle/{uuid}/{rank}", dist._get_reconfigure_handle())
        handles = [store.get(f"handle/{uuid}/{r}").decode() for r in members]
        dist._reconfigure(uuid, handles).wait()

    reconfigure()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    step, stop = 0, Stop(a.stop_file, a.steps)
    while not stop.reached(step):
        before = [p.detach().clone() for p in m.parameters()]
        try:
            opt.zero_grad()
            loss_of(m, step, rank, a.step_ms).backward()
            _average(_grads(m), len(members))
            opt.step()
            ev.emit("commit", step=step, world=len(members))
            step += 1
        except RuntimeError:  # gloo raises RuntimeError, ours DistBackendError (a subclass)
            # This failure is one death more than the ones this rank already left behind.
            gone = dead_ranks(store, world - len(members) + 1, datetime.timedelta(seconds=600))
            members = [r for r in members if r not in gone]
            uuid += 1
            reconfigure()
            # An all_reduce may have finished on some ranks before the failure: agree on the
            # lowest step reached and roll the last update back where it went further.
            agreed = torch.tensor([step], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            if step > int(agreed):
                with torch.no_grad():
                    for p, b in zip(m.parameters(), before, strict=True):
                        p.copy_(b)
                step = int(agreed)
    ev.emit("final", digest=digest(m))
    dist.destroy_process_group()


def run_torchft(a: argparse.Namespace) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    replica = int(os.environ["REPLICA_GROUP_ID"])
    ev = Events(a.events, replica)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # its group's
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    settings = json.loads(a.torchft)
    pg_timeout = settings.pop("pg_timeout", None)
    if a.backend == "gloo":
        pg: ProcessGroupGloo | dist.ProcessGroup = ProcessGroupGloo(
            **({"timeout": datetime.timedelta(seconds=pg_timeout)} if pg_timeout else {})
        )
    else:
        world = int(os.environ["NUM_REPLICA_GROUPS"])  # as torchft's train_ddp.py reads it
        pg = _native_group(a.backend, store, replica, world, pg_timeout or _TORCHFT_PG_TIMEOUT_S)
    # The Manager's own settings: durations in seconds, counts as they are.
    kw = {
        k: datetime.timedelta(seconds=v)
        if k in ("timeout", "quorum_timeout", "connect_timeout", "heartbeat_interval")
        else v
        for k, v in settings.items()
    }
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda sd: (m.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": m.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica_{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        **kw,
    )
    ddp = DistributedDataParallel(manager, m)
    optimizer = Optimizer(manager, opt)
    stop = Stop(a.stop_file, a.steps)
    while not stop.reached(manager.current_step()):
        optimizer.zero_grad()  # starts the quorum
        step = manager.current_step()
        loss_of(ddp, step, replica, a.step_ms).backward()
        optimizer.step()  # steps only if every participant's all_reduce succeeded
        if manager.current_step() > step:
            ev.emit("commit", step=step, world=manager.num_participants())
    ev.emit("final", digest=digest(m))
    manager.shutdown()


# torchft's ProcessGroupGloo's default op timeout, given to a native group when none is set.
_TORCHFT_PG_TIMEOUT_S = 60.0


def _native_group(
    backend: str, store: dist.Store, rank: int, world: int, timeout_s: float
) -> dist.ProcessGroup:
    """A native torch ProcessGroup whose CPU backend is ours, as torchft's Manager takes one
    (its manager_integ_test.py does the same with gloo): created with `enable_reconfigure`, so
    it connects nothing until the Manager's first `reconfigure` hands it the quorum's handles.
    The handles carry the peers' addresses, so the replica's own store is enough."""
    from resilient_comm import _C

    prefixed = dist.PrefixStore("native", store)  # apart from the Manager's keys on the same store
    pg = dist.ProcessGroup(prefixed, rank, world)
    ours = _C.create_backend(backend, prefixed, rank, world, timeout_s, f"torchft_native_{rank}", True)
    # The type is only the key the group dispatches CPU ops by; GLOO's, as torchft's own native
    # test registers its backend, so nothing in torch or torchft looks for another one.
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, ours)
    return pg


def run_ours(a: argparse.Namespace) -> None:
    from resilient_comm.elastic import Controller, TrainState

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    ev: Events | None = None

    def hook(event: str, info: dict[str, Any]) -> None:
        if event == "step.committed" and ev is not None:
            ev.emit("commit", step=info["step"], world=ctl.groups.world.size())

    ctl = Controller(state=TrainState(m, opt), hook=hook)
    ev = Events(a.events, ctl.place.rank)
    stop = Stop(a.stop_file, a.steps)
    for s in ctl.steps(a.steps):
        if stop.reached(s.step):
            break  # every member reads the same last step before reaching it
        with s:
            opt.zero_grad()
            loss_of(m, s.step, ctl.slot, a.step_ms).backward()
            s.commit(opt.step, grads=_grads(m))
    ev.emit("final", digest=digest(m))
    ctl.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stack", required=True, choices=("torchrun", "reconfigure", "torchft", "ours"))
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=1_000_000, help="a cap; the bench's stop file ends the run")
    p.add_argument("--stop-file", default="", help="holds the last step, once the bench writes it")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=0.0, help="the group's op timeout (0: torch's default)")
    p.add_argument("--torchft", default="{}", help="torchft's settings, JSON")
    a = p.parse_args(argv)
    {"torchrun": run_torchrun, "reconfigure": run_reconfigure, "torchft": run_torchft, "ours": run_ours}[
        a.stack
    ](a)


if __name__ == "__main__":
    main()
