"""A `resilient-comm chaos` trial: its kinds, the fault it injects (`Trial`, `LinkFault`), what
came of it (`Outcome`), and the toy's settings every trial runs with. Shared by the trials on
this machine (`chaos`) and those on several nodes (`chaos_nodes`), which `chaos` drives."""

from __future__ import annotations

from dataclasses import dataclass, field

from resilient_comm.config import knob

KINDS = (
    "kill",
    "kill2",
    "kill-in-recovery",
    "kill-decider",
    "kill-last-vote",
    "kill-checkpointing",
    "stop-short",
    "stop-long",
    "spare",
    "tp2",
    "bitflip",
    "slow-rank",
    "flap",
    "slow-link",
)
NODE_KINDS = ("flap", "slow-link")  # on several nodes (`chaos_nodes`)
STEP_MS = 25  # compute per step: the job runs long enough for heartbeats to tell its phases
FINGERPRINT_EVERY = 5  # the replicas compare their state this often in a short trial
FINGERPRINT_KNOB = "RESILIENT_COMM_FINGERPRINT_EVERY"
# A long trial compares at the knob's default interval, as a job that sets nothing does, so it
# must run past that interval's first comparison (after step 99) and end a good many steps
# later, with the run's last comparison apart from it: 160 steps, ~4 s of the toy's steps.
DEFAULT_EVERY = int(knob(FINGERPRINT_KNOB).default)
LONG_STEPS = 160
SHORT_ONLY = ("slow-rank", *NODE_KINDS)  # always short: see chaos's module docstring
# slow-rank: 0.05 core makes a rank's step (25 ms asleep, 5 ms of CPU) 0.29-0.51 of its peers'
# speed (0.1 core: 0.35-0.48 mostly, but in 2 of 3 tries a rank 0 stayed at 0.8-0.97 and was
# never judged, the step being mostly asleep); healthy ranks measured 0.83-1.24 (windows of 2
# and 4 steps, 4 ranks, and 8 on the nodes of flap and slow-link, this 2-core machine). The
# judge's sure rule (two windows under 0.6, model/pace.py) finds it, and 0.6 is under
# (dp-1)/dp - margin too, so its replica is dropped. SLOW_BELOW: the horizon's threshold.
SLOW_CORES, SLOW_BURN_MS, SLOW_BELOW = 0.05, 5, 0.65


@dataclass
class LinkFault:
    """One node's link, from rank 0's start of each `at` step (held there while the fault
    begins) for its seconds: down (`mbit` 0) or limited to `mbit` megabits per second."""

    node: int
    at: list[tuple[int, float]]
    mbit: float = 0.0


@dataclass
class Trial:
    index: int
    kind: str
    steps: int
    every: int | None  # steps between the replicas' comparisons; None: the knob's default
    args: list[str]  # the toy's fault arguments
    victims: list[int]  # ranks that die or are stopped past the bound
    stop: tuple[int, int, float] | None = None  # (rank, step, hold seconds)
    spares: int = 0
    tp: int = 1
    slow: tuple[int, int, float] | None = None  # (rank, step, CPU cores): a quota from that step on
    link: LinkFault | None = None  # flap, slow-link: the fault on one node's link

    @property
    def interval(self) -> int:
        """Steps between the replicas' periodic comparisons."""
        return DEFAULT_EVERY if self.every is None else self.every

    def describe(self) -> str:
        """The fault, as a trial's line shows it (and a long trial's length)."""
        what = " ".join(self.args)
        if self.slow:
            what = f"rank {self.slow[0]} at {self.slow[2]:g} core from step {self.slow[1]}"
        if self.link:
            how = f"limited to {self.link.mbit:g} Mbit/s" if self.link.mbit else "down"
            what = f"node {self.link.node}'s link {how} " + ", ".join(
                f"{secs:.2f} s at step {step}" for step, secs in self.link.at
            )
        if self.every is None:
            what += f" [{self.steps} steps, compared every {self.interval}]"
        return what


@dataclass
class Outcome:
    index: int
    kind: str
    args: list[str]
    steps: int
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    status: int | None = None
    hang: bool = False
    divergent: bool = False
    false_evictions: list[int] = field(default_factory=list)
    recovery_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""  # what the fault did, where a kind says (a trial's line shows it)

    def fail(self, why: str) -> None:
        self.ok = False
        self.problems.append(why)


__all__ = [
    "DEFAULT_EVERY",
    "FINGERPRINT_EVERY",
    "FINGERPRINT_KNOB",
    "KINDS",
    "LONG_STEPS",
    "NODE_KINDS",
    "SHORT_ONLY",
    "SLOW_BELOW",
    "SLOW_BURN_MS",
    "SLOW_CORES",
    "STEP_MS",
    "LinkFault",
    "Outcome",
    "Trial",
]
