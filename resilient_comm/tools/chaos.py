"""`resilient-comm chaos`: seeded fault trials against a deterministic training job.

Each trial runs the elastic toy (``resilient_comm.testing.toy``: an MLP whose every correct run
ends bit-identical to a fault-free reference) under resilient-run's Launcher and injects one
kind of fault with a real signal, at a point drawn from the seed:

==================  ==============================================================================
kill                one rank SIGKILLs itself at a step's start, sync or commit
kill2               two ranks, at two steps
kill-in-recovery    one rank, then a second during the recovery it started (joined or agreed)
kill-decider        the same, the second being the recovery's decider (the lowest live member)
kill-last-vote      one rank right after the last step committed (the job must still exit 0)
kill-checkpointing  one rank while the controller writes async checkpoints every 3 steps
stop-short          SIGSTOP for 0.3 s, under the silence bound: nobody may be evicted
stop-long           SIGSTOP for 3 s: the stopped rank is evicted, the others go on
spare               one rank killed with a hot spare waiting: the spare takes its place
tp2                 tp=2: one rank killed, its whole replica goes
bitflip             one bit of one rank's parameters flipped after a step (silent data corruption):
                    the replicas' next fingerprint comparison finds it, every member goes back
slow-rank           one rank held to 0.05 core by a CPU quota on its cgroup from a step on (fail-slow
                    detection on): it must be judged slow and leave, its replica dropped
flap                several nodes (network namespaces, etcd): one node's link down for less than
                    the tolerated outage, once or twice: nothing may happen
slow-link           the same nodes: one node's link limited to 20-50 Mbit/s for a few seconds:
                    slower steps, nobody evicted (a slow link is no dead or slow rank)
==================  ==============================================================================

and checks: no hang (the job ends within --timeout-s), exit status 0, every member of the last
decision at the final step, replicas bit-identical, and equal to the reference (a fault-free
run continued from each recovery's resume step with the survivors' data streams; with a spare,
the fault-free run itself; tp2 compares the replicas of each shard only), no false eviction
(nobody lost or evicted but the victims and their replica partners), a long trial's replicas
compared after step 99 and after the last step (where no recovery began right after that
step's commit), and the recovery time.

A trial is short (``--steps``, 24, the replicas comparing every 5 steps) or long: every trial
of the second round through the kinds, and of every other round after it (trials 15-28 of
fourteen kinds), runs ``--long-steps`` (160) steps with the comparison at its default interval
(RESILIENT_COMM_FINGERPRINT_EVERY unset for the job, whatever the caller's environment says),
so that it runs past the comparison after step 99 and the run's last, as a job that sets
nothing does. Its fault is drawn over the whole run: a kill anywhere, a bit flipped after any
step (found by the comparison after step 99 or by the run's last), kill-last-vote at its last
step. slow-rank, flap and slow-link stay short: slow-rank's pace window grows with the run (a
sixth of it), so its victim would crawl at 0.05 core for tens of seconds before a verdict; the
node kinds' bench makes one fault-free reference on its nodes, for one length, and a long run
of 8 ranks on one machine adds little that the local long trials do not check.

slow-rank needs root and the cpu controller (cgroup v1 or v2); flap and slow-link need root, network
namespaces and etcd, and run on --nodes nodes of two ranks each (`chaos_nodes`), their
reference a fault-free run on those nodes. A kind that cannot run here is refused when named,
skipped with a note when every kind was asked for (no --kinds).
Prints one line per trial and a table per kind; ``--out FILE`` writes every trial as JSON.
Exit status 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from resilient_comm.tools.chaos_trial import (
    DEFAULT_EVERY,
    FINGERPRINT_EVERY,
    FINGERPRINT_KNOB,
    KINDS,
    LONG_STEPS,
    NODE_KINDS,
    SHORT_ONLY,
    SLOW_BELOW,
    SLOW_BURN_MS,
    SLOW_CORES,
    STEP_MS,
    Outcome,
    Trial,
)

PHASES = ("start", "synced", "committed")
STOP_SHORT_S, STOP_LONG_S = 0.3, 3.0


def pace_window(steps: int) -> int:
    """Fail-slow detection's window in a run of `steps` steps: short enough that three windows
    fit after the slowdown (two are the patience; a window in which the slow rank was near
    its peers' speed, on a loaded machine, starts the streak again; not in the fewest steps, 10),
    and steps after it left."""
    return max(2, steps // 6)


def is_long(index: int, kind: str, kinds: int) -> bool:
    """Whether trial `index` of a run that takes `kinds` kinds in turn is long: every trial of
    the second round through the kinds and of every other round after it (every kind gets long
    trials; a fixed stride such as every 4th, with an even number of kinds, would only ever
    lengthen the same ones), but never slow-rank, flap or slow-link's."""
    return (index // kinds) % 2 == 1 and kind not in SHORT_ONLY


def draw(
    index: int,
    kind: str,
    rng: random.Random,
    world: int,
    steps: int,
    nodes: int = 4,
    long_steps: int = 0,
) -> Trial:
    """The fault of trial `index`: where and when, from the seeded `rng` (flap and slow-link:
    on `nodes` nodes). `long_steps`: a long trial of that many steps, compared at the default
    interval, instead of `steps` steps compared every `FINGERPRINT_EVERY`."""
    if long_steps and kind in SHORT_ONLY:
        raise ValueError(f"{kind} trials are short only ({', '.join(SHORT_ONLY)} never run long)")
    if kind in NODE_KINDS:
        from resilient_comm.tools import chaos_nodes

        return chaos_nodes.draw(index, kind, rng, nodes, steps)
    every = None if long_steps else FINGERPRINT_EVERY
    steps = long_steps or steps

    def trial(args: list[str], victims: list[int], **fault: Any) -> Trial:
        return Trial(index, kind, steps, every, args, victims, **fault)

    step = rng.randrange(3, steps - 5)
    victim = rng.randrange(world)
    phase = rng.choice(PHASES)
    kill = ["--kill", f"{victim}:{step}:{phase}"]
    if kind == "kill":
        return trial(kill, [victim])
    if kind == "kill2":
        other = rng.choice([r for r in range(world) if r != victim])
        later = rng.randrange(step, steps - 4)
        return trial([*kill, "--kill", f"{other}:{later}:{rng.choice(PHASES)}"], [victim, other])
    if kind in ("kill-in-recovery", "kill-decider"):
        survivors = [r for r in range(world) if r != victim]
        second = survivors[0] if kind == "kill-decider" else rng.choice(survivors)
        return trial([*kill, "--kill", f"{second}:1:{rng.choice(('joined', 'agreed'))}"], [victim, second])
    if kind == "kill-last-vote":
        return trial(["--kill", f"{victim}:{steps - 1}:committed"], [victim])
    if kind == "kill-checkpointing":
        return trial([*kill, "--ckpt-dir-every", "3"], [victim])
    if kind == "stop-short":
        return trial(["--mark", f"{victim}:{step}"], [], stop=(victim, step, STOP_SHORT_S))
    if kind == "stop-long":
        # Past a few heartbeats: a rank whose last beat came before its first step is held to
        # the start-up bound (ten floors), longer than this stop.
        step = max(step, 10)
        return trial(["--mark", f"{victim}:{step}"], [victim], stop=(victim, step, STOP_LONG_S))
    if kind == "spare":
        return trial(kill, [victim], spares=1)
    if kind == "tp2":
        return trial(["--tp", "2", *kill], [victim], tp=2)
    if kind == "bitflip":
        # Short: before the last periodic comparison, so that one finds it. Long: after any
        # step, found by the comparison after step 99 or by the run's last.
        end = steps if every is None else steps - every - (steps % every)
        return trial(["--flip", f"{victim}:{rng.randrange(1, end)}"], [])
    if kind == "slow-rank":  # two whole windows (the patience) after the quota, and one to spare
        window = pace_window(steps)
        at = rng.randrange(2, max(3, steps - 4 * window - 1))
        pace = [
            "--burn-ms",
            str(SLOW_BURN_MS),
            "--pace-window",
            str(window),
            "--pace-slow-below",
            str(SLOW_BELOW),
        ]
        return trial(["--mark", f"{victim}:{at}", *pace], [victim], slow=(victim, at, SLOW_CORES))
    raise ValueError(f"unknown trial kind {kind!r} (kinds: {', '.join(KINDS)})")


class Reference:
    """Fault-free runs of the toy: the whole run's trace, and continuations from a step with
    given data streams (cached)."""

    def __init__(
        self, world: int, steps: int, workdir: str, timeout_s: float, trace: dict[int, Any] | None = None
    ) -> None:
        """`trace`: the fault-free run's trace ({step: {step, state}}), if already made."""
        self.world, self.steps, self.workdir, self.timeout_s = world, steps, workdir, timeout_s
        self._runs = 0
        if trace is None:
            import torch

            path = os.path.join(workdir, "fault-free.pt")
            self._run(world, ["--trace", path], "fault-free")
            trace = torch.load(path, weights_only=False)
        self.trace: dict[int, Any] = trace
        self._cache: dict[tuple, Any] = {}

    def _run(self, nproc: int, args: list[str], name: str) -> None:
        """One fault-free run. A run that had a recovery of its own (a rank starved long enough to
        be suspected on a loaded machine) is not a reference: it is run again."""
        from resilient_comm.testing.toy import ToyJob

        for attempt in range(3):
            job = ToyJob(
                nproc,
                args if "--steps" in args else ["--steps", str(self.steps), *args],
                os.path.join(self.workdir, name if attempt == 0 else f"{name}-again{attempt}"),
                quiet=True,
            ).start()
            status = job.wait(self.timeout_s)
            events = job.events()
            if status == 0 and not any(e["event"] in ("restored", "evicted", "failed") for e in events):
                return
        raise RuntimeError(f"the fault-free reference run {name} failed 3 times; last: {events[-3:]}")

    def final(self, segments: list[tuple[int, list[int]]]) -> Any:
        """The state after the last step of a run that resumed at each (step, data streams)."""
        import torch

        state = self.trace[self.steps - 1]
        for i, (resume, streams) in enumerate(segments):
            end = segments[i + 1][0] if i + 1 < len(segments) else self.steps
            if not 0 < resume < end:
                raise ValueError(f"segment {i} resumes at step {resume}, not within (0, {end}): {segments}")
            # A segment's result depends on where it ends as much as on what came before it.
            key = (tuple((step, tuple(ids)) for step, ids in segments[: i + 1]), end)
            if key not in self._cache:
                self._runs += 1
                name = f"ref-{self._runs}"
                src, trace = (
                    os.path.join(self.workdir, f"{name}-start.pt"),
                    os.path.join(self.workdir, f"{name}.pt"),
                )
                torch.save(self.trace[resume - 1] if i == 0 else state, src)
                self._run(
                    len(streams),
                    [
                        "--steps",
                        str(end),
                        "--resume-from",
                        src,
                        "--trace",
                        trace,
                        "--data-ids",
                        ",".join(map(str, streams)),
                    ],
                    name,
                )
                steps = torch.load(trace, weights_only=False)
                if sorted(steps) != list(range(resume, end)):
                    raise RuntimeError(
                        f"reference run {name} traced steps {sorted(steps)}, not {resume}..{end - 1}"
                    )
                self._cache[key] = steps[end - 1]
            state = self._cache[key]
        return state["state"]


def run_trial(t: Trial, world: int, workdir: str, timeout_s: float, ref: Reference) -> Outcome:
    """One trial on this machine (not flap or slow-link: `chaos_nodes.NodeBench.run_trial`);
    `ref`: the fault-free runs of `t.steps` steps."""
    import torch

    from resilient_comm.elastic import Membership
    from resilient_comm.testing.harness import same_state, wait_for
    from resilient_comm.testing.toy import ToyJob

    if ref.steps != t.steps:
        raise ValueError(f"trial {t.index} runs {t.steps} steps, its reference {ref.steps}")
    steps = t.steps
    out = Outcome(t.index, t.kind, t.args, steps)
    quota = None
    dump = os.path.join(workdir, "dump")
    hold = ["--hold", "0:1"] if t.spares else []  # the kill comes after the spare registered
    every = [] if t.every is None else ["--fingerprint-every", str(t.every)]
    args = ["--steps", str(steps), "--step-ms", str(STEP_MS), *every, "--dump", dump, *t.args, *hold]
    if "--ckpt-dir-every" in args:
        args += ["--ckpt-dir", os.path.join(workdir, "ckpt")]
    # Empty is unset to the knob: the default interval, whatever the caller's environment says.
    env = {FINGERPRINT_KNOB: ""} if t.every is None else {}
    t0 = time.monotonic()
    job = ToyJob(world, args, workdir, quiet=True, spares=t.spares, env=env).start()
    store = job.launcher.client()
    m = Membership(store, job.launcher.namespace)
    try:
        if t.spares:
            wait_for(lambda: len(m.spares()) >= t.spares, "the spare to register")
            store.set("toy/go/1", "1")
        if t.stop:
            rank, step, hold_s = t.stop
            store.wait([f"toy/at/{rank}/{step}"], datetime.timedelta(seconds=timeout_s))
            os.kill(job.pid(rank), signal.SIGSTOP)
            try:
                time.sleep(hold_s)  # the fault's duration (what the trial is about), not a synchronisation
            finally:
                os.kill(job.pid(rank), signal.SIGCONT)
        if t.slow:  # held until the job ends: a slow host stays slow
            from resilient_comm.testing.cgroup import CpuQuota

            rank, step, cores = t.slow
            store.wait([f"toy/at/{rank}/{step}"], datetime.timedelta(seconds=timeout_s))
            try:
                quota = CpuQuota(job.pid(rank), cores)
            except OSError as e:
                out.fail(f"no CPU quota for rank {rank}: {e}")
        out.status = job.wait(max(1.0, timeout_s - (time.monotonic() - t0)))
    except TimeoutError:
        out.hang = True
        out.fail(f"hang: the job did not end within {timeout_s:.0f} s")
        return out
    finally:
        if quota is not None:
            quota.release()
        out.seconds = time.monotonic() - t0
    if out.status != 0:
        out.fail(f"exit status {out.status}")
    decisions = [d for e in range(m.epoch() + 1) if (d := m.decision(e)) is not None]
    last = decisions[-1]
    partners = _replica_partners(t, world)
    out.false_evictions = sorted(
        {r for d in decisions for r in (*d.lost, *d.evicted)} - set(t.victims) - partners
    )
    if out.false_evictions:
        out.fail(f"false eviction of {out.false_evictions}")
    if t.kind == "stop-long" and not any(t.victims[0] in d.lost for d in decisions):
        out.fail(f"rank {t.victims[0]}, stopped for {STOP_LONG_S} s, was not evicted")
    if t.kind == "bitflip" and not any(e["event"] == "mismatch" for e in job.events()):
        out.fail("the flipped bit was never found")
    if t.slow:
        _check_slow(out, t.slow, decisions, job.events())
    if t.every is None:
        _check_compared(out, t, decisions, job.events())
    killed = {e["rank"] for e in job.events() if e["event"] == "kill"}
    alive = [r for r in last.members if r not in killed]
    finals = {}
    for r in alive:
        path = os.path.join(dump, f"final-{r}.pt")
        if not os.path.exists(path):
            out.fail(f"member {r} left no final state")
            continue
        finals[r] = torch.load(path, weights_only=False)
        if finals[r]["committed"] != steps - 1:
            out.fail(f"member {r} ended at step {finals[r]['committed']}, not {steps - 1}")
        out.recovery_ms += [tl["ms"]["total"] for tl in finals[r]["recoveries"]]
    if not finals:
        return out
    groups: dict[int, list[int]] = {}
    for r in finals:
        groups.setdefault(last.members.index(r) % t.tp, []).append(r)
    for shard in groups.values():
        if any(not same_state(finals[r]["state"], finals[shard[0]]["state"]) for r in shard):
            out.divergent = True
            out.fail(f"replicas {shard} differ")
    if t.tp == 1 and not out.divergent:
        try:
            want = ref.final(_segments(decisions, steps))
        except (RuntimeError, ValueError, OSError, TimeoutError) as e:
            out.fail(f"no reference: {e}")
            return out
        if not same_state(finals[alive[0]]["state"], want):
            out.divergent = True
            out.fail("the final state differs from the fault-free reference")
    return out


def _check_slow(out: Outcome, slow: tuple[int, int, float], decisions: list[Any], events: list[dict]) -> None:
    """The rank held to a quota was judged slow by its peers and left (its replica dropped in
    a planned recovery), not found silent or never noticed."""
    rank, step, cores = slow
    verdicts = [e for e in events if e["event"] == "slow" and rank in e["leave"]]
    left = any(rank in (*d.lost, *d.evicted) for d in decisions)
    if not left:
        out.fail(f"rank {rank}, at {cores:g} core from step {step}, never left")
    elif not verdicts:
        out.fail(f"rank {rank} left without being judged slow")
    else:
        out.note = f"judged slow after step {verdicts[0]['step']}: {verdicts[0]['why']}"


def _check_compared(out: Outcome, t: Trial, decisions: list[Any], events: list[dict]) -> None:
    """The replicas compared their state after every `t.interval`-th step and after the last,
    each at least once (a comparison that found a flipped bit ran again after going back). A
    recovery that resumed right after such a step's commit (a rank killed as it committed, the
    comparison's gather failing) started a new baseline instead: that comparison is not due."""
    compared = {e["step"] for e in events if e["event"] in ("agreed", "mismatch")}
    resumed = {d.resume_step for d in decisions[1:]}
    due = [*range(t.interval - 1, t.steps - 1, t.interval), t.steps - 1]
    missed = [s for s in due if s not in compared and s + 1 not in resumed]
    if missed:
        out.fail(f"the replicas never compared after step(s) {missed} (compared after {sorted(compared)})")


def _segments(decisions: list[Any], steps: int) -> list[tuple[int, list[int]]]:
    """(resume step, data streams) of each recovery that changed the data streams."""
    segs: list[tuple[int, list[int]]] = []
    streams = list(range(len(decisions[0].members)))
    for d in decisions[1:]:
        now = list(d.slots) if d.slots else list(d.members)
        if now != streams:
            if segs and segs[-1][0] == d.resume_step:
                segs.pop()  # a recovery of the recovery: nothing ran with the streams in between
            segs.append((d.resume_step, now))
            streams = now
    # A recovery after the last step (its vote counted) ran nothing with its streams.
    return [sg for sg in segs if sg[0] < steps]


def _replica_partners(t: Trial, world: int) -> set[int]:
    return {r for v in t.victims for r in range(world) if r // t.tp == v // t.tp}


def summarize(outcomes: list[Outcome]) -> str:
    rows = [
        ("kind", "trials", "ok", "hangs", "divergent", "false evictions", "exit != 0", "recovery median ms")
    ]
    for kind in [k for k in KINDS if any(o.kind == k for o in outcomes)] + ["all"]:
        sel = [o for o in outcomes if kind in ("all", o.kind)]
        rec = [ms for o in sel for ms in o.recovery_ms]
        rows.append(
            (
                kind,
                str(len(sel)),
                str(sum(o.ok for o in sel)),
                str(sum(o.hang for o in sel)),
                str(sum(o.divergent for o in sel)),
                str(sum(bool(o.false_evictions) for o in sel)),
                str(sum(o.status not in (0, None) for o in sel)),
                f"{statistics.median(rec):.0f}" if rec else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )


def unavailable(kind: str) -> str | None:
    """Why trials of `kind` cannot run here, or None."""
    if kind == "slow-rank":
        from resilient_comm.testing import cgroup

        return cgroup.available()
    if kind in NODE_KINDS:
        from resilient_comm.tools import chaos_nodes

        return chaos_nodes.unavailable(kind)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-comm chaos",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    p.add_argument("--trials", type=int, default=20, help="how many trials (default 20)")
    p.add_argument("--seed", type=int, default=1, help="draws every fault's kind, rank, step and phase")
    p.add_argument(
        "--kinds",
        default=None,
        help="comma-separated trial kinds (default: every kind that can run here, in turn)",
    )
    p.add_argument(
        "--world", type=int, default=4, help="ranks per trial (default 4; tp2 needs an even number)"
    )
    p.add_argument(
        "--nodes", type=int, default=4, help="flap and slow-link: nodes of two ranks each (default 4)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=24,
        help=f"training steps per short trial, compared every {FINGERPRINT_EVERY} (default 24)",
    )
    p.add_argument(
        "--long-steps",
        type=int,
        default=LONG_STEPS,
        help=f"training steps per long trial, compared at the default interval ({DEFAULT_EVERY}): every "
        f"trial of every second round through the kinds, except {', '.join(SHORT_ONLY)} (default "
        f"{LONG_STEPS}; 0: none)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="a trial still running after this is a hang"
    )
    p.add_argument("--out", default=None, help="write every trial's outcome here (JSON)")
    p.add_argument(
        "--workdir", default=None, help="keep the trials' files here (default: a temporary directory)"
    )
    a = p.parse_args(argv)
    kinds = [k for k in (a.kinds or ",".join(KINDS)).split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        p.error(f"unknown kinds {bad} (kinds: {', '.join(KINDS)})")
    if a.trials < 1 or a.world < 2 or a.steps < 10 or a.nodes < 3:
        p.error("needs --trials >= 1, --world >= 2, --steps >= 10 and --nodes >= 3")
    if a.long_steps and a.long_steps < DEFAULT_EVERY + 10:
        p.error(f"--long-steps must run past the default comparison interval: 0 or >= {DEFAULT_EVERY + 10}")
    if "tp2" in kinds and a.world % 2:
        p.error("tp2 trials need an even --world")
    why = {k: w for k in dict.fromkeys(kinds) if (w := unavailable(k))}
    if why and a.kinds:
        p.error("; ".join(f"{k} trials cannot run here: {w}" for k, w in why.items()))
    for k, w in why.items():
        print(f"chaos: no {k} trials here: {w}", flush=True)
    kinds = [k for k in kinds if k not in why]
    rng = random.Random(a.seed)
    trials = []
    for i in range(a.trials):
        kind = kinds[i % len(kinds)]
        long_steps = a.long_steps if is_long(i, kind, len(kinds)) else 0
        trials.append(draw(i, kind, rng, a.world, a.steps, a.nodes, long_steps))
    with tempfile.TemporaryDirectory(prefix="rc-chaos-") as tmp, contextlib.ExitStack() as stack:
        root = a.workdir or tmp
        os.makedirs(root, exist_ok=True)
        local, linked = sum(not t.link for t in trials), sum(bool(t.link) for t in trials)
        long = sum(t.every is None for t in trials)
        where = [f"{local} on {a.world} ranks"] if local else []
        if linked:
            where.append(f"{linked} on {a.nodes} nodes of 2 ranks")
        length = f"{a.steps} steps compared every {FINGERPRINT_EVERY}"
        if long:
            length += f" ({long} long: {a.long_steps} steps compared every {DEFAULT_EVERY})"
        print(
            f"chaos: {a.trials} trials, seed {a.seed}, {length}, {' and '.join(where)}; "
            "fault-free reference...",
            flush=True,
        )
        # One per length: a segment's result depends on where the run ends.
        refs = {
            n: Reference(a.world, n, os.path.join(root, f"reference-{n}"), a.timeout_s)
            for n in sorted({t.steps for t in trials if not t.link})
        }
        bench = None
        if linked:
            from resilient_comm.tools.chaos_nodes import NodeBench

            bench = stack.enter_context(NodeBench(a.nodes, a.steps, os.path.join(root, "nodes"), a.timeout_s))
        outcomes = []
        for t in trials:
            trial_dir = os.path.join(root, f"trial-{t.index}")
            if bench is not None and t.link:
                o = bench.run_trial(t, trial_dir)
            else:
                o = run_trial(t, a.world, trial_dir, a.timeout_s, refs[t.steps])
            outcomes.append(o)
            rec = f"{max(o.recovery_ms):.0f} ms" if o.recovery_ms else "-"
            print(
                f"[{t.index + 1}/{a.trials}] {t.kind:18s} {t.describe():42s} "
                f"{'ok' if o.ok else 'FAIL: ' + '; '.join(o.problems)} ({o.seconds:.1f} s, recovery {rec})"
                + (f"\n    {o.note}" if o.note else ""),
                flush=True,
            )
    print(summarize(outcomes))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "seed": a.seed,
                    "world": a.world,
                    "nodes": a.nodes,
                    "steps": a.steps,
                    "long_steps": a.long_steps,
                    "trials": [asdict(o) for o in outcomes],
                },
                f,
                indent=1,
            )
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
