"""One member's side of fail-slow detection (`model/pace.py`): it times its own compute each
step where the compute runs (`step_timer.py`: on an accelerator, the device's time, not the
host's) and, every `window` steps, gathers every member's median, node and receive rates, and
judges. Runs in a worker, on its training thread: `step_started` at a step's start,
`step_computed` at its commit, before the step's first wait on the others, and the window's
judgement after the commit (`Controller._begin`, `Controller._commit`).

A window costs one all-gather on the world group of 2 + 2 x PEERS floats per member (its
median compute, its node, and the typical rate at which it received from each of the PEERS
peers it received most from in the window, for telling a slow link from a slow rank: a
constant size at any scale; on this 2-core machine ~2-3 ms for 4 ranks; benchmarks/README.md);
where a rank is slow and no one has said yet how many hot spares wait, one broadcast more
(world rank 0 reads the membership: every member then acts on the same number).
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from resilient_comm.api import resilient_backend
from resilient_comm.elastic.model.pace import Pace, PaceConfig, PaceVerdict
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.worker.errors import Evicted
from resilient_comm.elastic.worker.step_timer import StepTimer, step_timer

log = logging.getLogger("resilient_comm.elastic")
PEERS = 4  # receive rates per member and window: a ring's or a tree's peers, and then some
RATE_BUCKETS_PER_DOUBLING, RATE_FLOOR = 4, 2.0**20  # csrc/transport/tcp/transfer.h, [Note: link rates]


def own_node(rank: int) -> int:
    """This process's node: the launcher's GROUP_RANK; where none says, a node of its own."""
    node = os.environ.get("GROUP_RANK", "")
    return int(node) if node.isdigit() else -1 - rank


class PaceWatch:
    def __init__(self, cfg: PaceConfig, rank: int) -> None:
        if cfg.window < 0:
            raise ValueError(f"the pace window must be >= 0 steps, got {cfg.window}")
        self.cfg, self.rank = cfg, rank
        self.node = own_node(rank)
        self.pace = Pace(cfg)
        self._compute: list[float] = []
        self._timer: tuple[torch.device, StepTimer] | None = None  # made at the first step
        self.verdicts: list[PaceVerdict] = []  # every window that found a slow rank or link, in order
        # The receive histograms at the window's start, and the backend they were read from.
        self._rx_base: tuple[object, dict[int, list[int]]] | None = None
        self._told_no_rates = False

    def step_started(self, device: torch.device) -> None:
        """A step's compute starts, on `device` (on an accelerator: on its current stream)."""
        if not self.cfg.window:
            return
        if self._timer is None or self._timer[0] != device:
            self._timer = (device, step_timer(device))
        self._timer[1].start()

    def step_computed(self) -> None:
        """The step's compute ends: what follows waits on the others. The times of earlier
        steps that can be read without waiting for the device are noted."""
        if self._timer is not None:
            timer = self._timer[1]
            timer.stop()
            for s in timer.take(wait=False):
                self.note(s)

    def note(self, compute_s: float) -> None:
        """This member's compute in a step, timed by the caller."""
        if self.cfg.window:
            self._compute.append(compute_s)

    def forget(self, members: list[int]) -> None:
        """A recovery: the window starts again, with these members."""
        self._compute.clear()
        if self._timer is not None:
            self._timer[1].clear()
        self._rx_base = None
        self.pace.forget(members)

    def due(self) -> bool:
        timed = len(self._compute) + (self._timer[1].pending if self._timer is not None else 0)
        return self.cfg.window > 0 and timed >= self.cfg.window

    def window_end(
        self,
        step: int,
        world: dist.ProcessGroup,
        members: list[int],
        mesh: Mesh,
        spares: Callable[[], int],
        emit: Callable[..., None],
    ) -> list[int]:
        """The window's judgement, as the controller runs it: logged, told to the hook
        (``pace.window`` every window, ``pace.slow`` when a rank is or was slow,
        ``pace.slow_link`` when a node's link became or stopped being slow, ``pace.no_link_rates``
        once where the world's backend gives no receive rates), and the ranks
        that leave. This member, if one of them, raises `Evicted` (it leaves at this step's
        end, committed); the others get the list and recover on purpose."""
        v = self.judge(step, world, members, mesh, spares, emit)
        emit("pace.window", step=step, speeds=v.speeds, links=v.links)
        for r in v.newly_slow:
            log.warning(
                "rank %d: rank %d is slow: %.2f of the typical member's speed over the last %d steps "
                "(the others wait for it)",
                self.rank,
                r,
                v.speeds[r],
                self.cfg.window,
            )
        for r in v.cleared:
            log.info("rank %d: rank %d is no longer slow (%.2f)", self.rank, r, v.speeds[r])
        for n in v.newly_slow_links:
            log.warning(
                "rank %d: node %d's link is slow: its transfers arrive at %.2f of the others' rate over "
                "the last %d steps, while its ranks compute at full speed (a slow link, not a slow rank: "
                "nobody is evicted for it)",
                self.rank,
                n,
                v.links[n],
                self.cfg.window,
            )
        for n in v.cleared_links:
            log.info("rank %d: node %d's link is no longer slow (%.2f)", self.rank, n, v.links[n])
        if v.newly_slow_links or v.cleared_links:
            emit("pace.slow_link", step=step, slow=v.slow_links, cleared=v.cleared_links, links=v.links)
        if v.slow or v.cleared:
            emit("pace.slow", step=step, slow=v.slow, cleared=v.cleared, leave=v.leave, why=v.why)
        if v.leave:
            log.warning("rank %d: after step %d: %s", self.rank, step, v.why)
        if self.rank in v.leave:
            raise Evicted(f"rank {self.rank} is slow ({v.slow[self.rank]:.2f} of its peers' speed): {v.why}")
        return v.leave

    def judge(
        self,
        step: int,
        world: dist.ProcessGroup,
        members: list[int],
        mesh: Mesh,
        spares: Callable[[], int],
        emit: Callable[..., None] | None = None,
    ) -> PaceVerdict:
        """Gather every member's median compute over the window, its node and what it
        received from each peer, and judge (the same on every member). `spares()`: the hot
        spares waiting, read by world rank 0 only when needed; `emit`: the hook."""
        if self._timer is not None:
            for s in self._timer[1].take(wait=True):
                self.note(s)
        mine = torch.full((2 + 2 * PEERS,), -1.0, dtype=torch.float64)
        mine[0], mine[1] = statistics.median(self._compute), self.node
        self._compute.clear()
        for k, (peer, rate) in enumerate(self._received(world, emit)):
            mine[2 + 2 * k], mine[3 + 2 * k] = peer, rate
        gathered = [torch.empty(2 + 2 * PEERS, dtype=torch.float64) for _ in members]
        dist.all_gather(gathered, mine, group=world)
        rows = {r: t.tolist() for r, t in zip(members, gathered, strict=True)}
        received = {
            (i, members[int(row[2 + 2 * k])]): row[3 + 2 * k]
            for i, row in rows.items()
            for k in range(PEERS)
            if 0 <= row[2 + 2 * k] < len(members)
        }
        node_of = {r: int(row[1]) for r, row in rows.items()}
        v = self.pace.judge(step, {r: row[0] for r, row in rows.items()}, received, node_of)
        if v.slow:
            waiting = torch.tensor([spares() if dist.get_rank(world) == 0 else 0], dtype=torch.int64)
            dist.broadcast(waiting, group_src=0, group=world)
            replica_of = {r: mesh.coords(i)["dp"] for i, r in enumerate(members)}
            self.pace.act(v, replica_of, mesh.dp, int(waiting.item()))
        if v.slow or v.slow_links or v.cleared or v.cleared_links:
            self.verdicts.append(v)
        return v

    def _received(
        self, world: dist.ProcessGroup, emit: Callable[..., None] | None
    ) -> list[tuple[int, float]]:
        """The PEERS world ranks this member received the most large frames from since the
        window began, each with its median frame's rate (bytes/s); none where that is not
        known: a communicator that is not TCP, or the first window of a new one (its counts
        start here), or a backend that is not resilient_comm's (said once)."""
        try:
            backend = resilient_backend(world, "fail-slow detection")
            now = {int(p): list(counts) for p, counts in backend.receive_rates()}
        except (ValueError, RuntimeError) as e:
            if not self._told_no_rates:
                self._told_no_rates = True
                log.warning(
                    "rank %d: fail-slow detection reads no receive rates from the world group (%s): "
                    "slow ranks are judged, slow links go unreported",
                    self.rank,
                    e,
                )
                if emit is not None:
                    emit("pace.no_link_rates", error=str(e))
            return []
        base, self._rx_base = self._rx_base, (backend, now)
        if base is None or base[0] is not backend:
            return []
        window = {
            p: [c - c0 for c, c0 in zip(counts, base[1].get(p, [0] * len(counts)), strict=True)]
            for p, counts in now.items()
        }
        busiest = sorted((p for p in window if sum(window[p]) > 0), key=lambda p: -sum(window[p]))[:PEERS]
        return [(p, median_rate(window[p])) for p in busiest]


def median_rate(counts: list[int]) -> float:
    """The median frame's rate (bytes/s) of a histogram of frames by rate bucket: the middle of
    its bucket."""
    half, seen = sum(counts) / 2, 0
    for b, c in enumerate(counts):
        seen += c
        if seen >= half:
            return RATE_FLOOR * 2.0 ** ((b + 0.5) / RATE_BUCKETS_PER_DOUBLING)
    return 0.0


__all__ = ["PaceWatch", "median_rate", "own_node"]
