"""One member's side of fail-slow detection (`model/pace.py`): it times its own compute each
step and, every `window` steps, gathers every member's median and judges. Runs in a worker, on
its training thread, after a step's commit (`Controller._commit`).

A window costs one all-gather of a float per member on the world group (on this 2-core
machine ~2-3 ms for 4 ranks; benchmarks/README.md); where a rank is slow and no one has said
yet how many hot spares wait, one broadcast more (world rank 0 reads the membership: every
member then acts on the same number).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from resilient_comm.elastic.model.pace import Pace, PaceConfig, PaceVerdict
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.worker.errors import Evicted

log = logging.getLogger("resilient_comm.elastic")


class PaceWatch:
    def __init__(self, cfg: PaceConfig, rank: int) -> None:
        if cfg.window < 0:
            raise ValueError(f"the pace window must be >= 0 steps, got {cfg.window}")
        self.cfg, self.rank = cfg, rank
        self.pace = Pace(cfg)
        self._compute: list[float] = []
        self.verdicts: list[PaceVerdict] = []  # every window that found a slow rank, in order

    def note(self, compute_s: float) -> None:
        """This member's compute in the step that is synchronising now."""
        if self.cfg.window:
            self._compute.append(compute_s)

    def forget(self, members: list[int]) -> None:
        """A recovery: the window starts again, with these members."""
        self._compute.clear()
        self.pace.forget(members)

    def due(self) -> bool:
        return self.cfg.window > 0 and len(self._compute) >= self.cfg.window

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
        (``pace.window`` every window, ``pace.slow`` when a rank is or was slow), and the
        ranks that leave. This member, if one of them, raises `Evicted` (it leaves at this
        step's end, committed); the others get the list and recover on purpose."""
        v = self.judge(step, world, members, mesh, spares)
        emit("pace.window", step=step, speeds=v.speeds)
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
        if v.slow or v.cleared:
            emit("pace.slow", step=step, slow=v.slow, cleared=v.cleared, leave=v.leave, why=v.why)
        if v.leave:
            log.warning("rank %d: after step %d: %s", self.rank, step, v.why)
        if self.rank in v.leave:
            raise Evicted(f"rank {self.rank} is slow ({v.slow[self.rank]:.2f} of its peers' speed): {v.why}")
        return v.leave

    def judge(
        self, step: int, world: dist.ProcessGroup, members: list[int], mesh: Mesh, spares: Callable[[], int]
    ) -> PaceVerdict:
        """Gather every member's median compute over the window and judge (the same on every
        member). `spares()`: the hot spares waiting, read by world rank 0 only when needed."""
        mine = torch.tensor([statistics.median(self._compute)], dtype=torch.float64)
        self._compute.clear()
        gathered = [torch.empty(1, dtype=torch.float64) for _ in members]
        dist.all_gather(gathered, mine, group=world)
        v = self.pace.judge(step, {r: float(t.item()) for r, t in zip(members, gathered, strict=True)})
        if v.slow:
            n = torch.tensor([spares() if dist.get_rank(world) == 0 else 0], dtype=torch.int64)
            dist.broadcast(n, group_src=0, group=world)
            replica_of = {r: mesh.coords(i)["dp"] for i, r in enumerate(members)}
            self.pace.act(v, replica_of, mesh.dp, int(n.item()))
            self.verdicts.append(v)
        return v


__all__ = ["PaceWatch"]
