"""Every collective of the resilient_tcp backend gives gloo's results on the same inputs.

Real processes, real sockets: each test starts one set of workers (``run_workers``), which
init ``resilient_tcp`` as the default group and a gloo group over the same ranks, then loop
over a matrix of (collective, dtype, reduce op, size) cases inside the worker. Every case runs
once on resilient_tcp and once on gloo with identical inputs; the worker collects each
difference as a line of text and returns the list, so one run_workers call covers a whole
world size (spawning a worker costs a torch import, ~1-2 s).

Collectives: all_reduce, reduce (non-root inputs must also stay unchanged, as the backend
documents), reduce_scatter (list), reduce_scatter_tensor, broadcast, all_gather (list),
all_gather_into_tensor, all_to_all (list; equal and unequal sizes, zero included),
all_to_all_single (equal split; explicit unequal split sizes over rows of a 2-D tensor),
gather, scatter (roots rotate), send/recv (tagged isend/irecv around the ring, all posted
before any wait, then a blocking send/recv), barrier (every rank must have arrived when it
returns). Tags go in the same order on both sides: the backend matches point-to-point
messages in order and treats a differing tag as an error (documented in communicator.h),
where gloo matches by tag.

Matrices (payloads between these same-host ranks go through the TCP transport's
shared-memory rings, the default; one case each of full, reduced, forced and p2p runs them
through the socket instead, RESILIENT_COMM_SHM=0: the `data_path` fixture in conftest.py)
  full     world sizes 2, 3, 4: 10 dtypes x every op x sizes 0, 1, 7, 1023 (plus 3 MiB cases)
  reduced  world sizes 1, 5, 8: 6 dtypes, sizes 0, 1, 1023, one 3 MiB case per collective
  forced   RESILIENT_COMM_ALGO=ring / =rd (set in os.environ inside the worker before init; the
           communicator reads it when it is created), the algorithm-dependent collectives at
           small and 3 MiB sizes: ring and rd at world size 3 (not a power of two), rd at 4
           and 6 (fewer cases), and ring at 4 with a 1000-byte pipelining chunk (fewer cases),
           so that it runs many chunks through its window of receive slots.
  lazy     RESILIENT_COMM_TCP_FULL_MESH=2: the reduced matrix at world sizes 5 and 8, where a rank
           connects its two ring neighbours at init and every other peer on first use (the path
           of groups larger than 64 ranks; csrc/transport/tcp/mesh.h).
  nccl     the same matrix on resilient_nccl with RESILIENT_COMM_NCCL_EMULATE=1 (CPU tensors on the
           NCCL code path: stream-ordered launches, NCCL groups, the NCCL emulator's kernels), at
           world sizes 1-5 and 8, with 1 ms kernels at world size 2; int16 is data only there
           (NCCL has no int16 reduction, which raises ValueError at the call: checked).
  p2p      a ~4 MiB isend/irecv exchange both ways at once, at world sizes 2 and 4, on fresh
           groups, back to back and with 20 ms between the isend and the irecv; it must finish
           well before the op timeout (it takes ~50 ms), not just eventually.

Gloo's support, checked on torch 2.13 (and how this file deals with it)
  * int16: gloo has no int16 at all ("Invalid scalar type" for every collective). The reference
    runs on gloo over the input widened to int32 and is narrowed back; inputs are chosen so
    that no int16 result overflows, which makes this exact.
  * AVG: compared against gloo SUM divided by the world size, in the dtype (float dtypes
    only). AVG on an integer dtype is an error in both backends; that it raises is checked.
  * bool: gloo reduces bool with SUM/MAX = or, PRODUCT/MIN = and; compared as is.
  * all_to_all (list) with unequal tensor sizes: gloo requires equal sizes, so the reference
    is gloo's all_to_all_single with the same split sizes (the same exchange).
  * reduce_scatter (list) at world sizes >= 5: the reference is gloo's reduce_scatter_tensor
    (gloo's list variant is ~6x slower and computes the same; at 2-4 ranks it is the list one).
  * Everything else (all listed collectives, all other dtypes) gloo supports; nothing skipped.

Comparison
  * Integer and bool dtypes: exact. Integer SUM inputs are large (up to max/n, so no result
    overflows, int16 included), MIN/MAX and data inputs span the whole range. MIN/MAX and
    data-movement collectives: exact for every dtype. Inputs that make float results exact are used wherever possible: small
    integer values for SUM/AVG ("int" inputs, |sum| <= 64 is exact even in bfloat16), values in
    {-1, 1, 2} for PRODUCT. Those compare exactly too (AVG: both sides divide the same exact sum
    once, correctly rounded).
  * Float SUM/AVG over random normal inputs ("randn" inputs) depend on the reduction order.
    Tolerance per element: |ours - gloo| <= 2 (n-1) eps * sum_i |x_i| + eps |gloo|, where n is the
    world size, x_i the ranks' inputs and eps the dtype's machine epsilon (float16 9.8e-4,
    bfloat16 7.8e-3, float32 1.2e-7, float64 2.2e-16). That is the standard bound on two
    summation orders of n terms (each rounding step errs by at most eps times a partial sum),
    plus one rounding of the result; AVG divides the bound by n. It holds for float16/bfloat16
    too, which are simply looser through their eps. On top of that, every rank must get a
    bitwise-identical all_reduce result (the backend promises it).
"""

from __future__ import annotations

import os
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, run_workers

OP_TIMEOUT_S = 30.0  # per-op deadline of both groups: a hang fails one case, not the test run
MAX_LINES = 40  # mismatch lines kept per rank

ALL_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
REDUCED_DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.int16, torch.int64, torch.bool]
FORCED_DTYPES = [torch.float16, torch.float32, torch.float64, torch.uint8, torch.int32, torch.bool]

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
REDUCE_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
}

LARGE_BYTES = 3 << 20  # "3 MiB of float32" = 786432 elements
P2P_LARGE_BYTES = 4 << 20

REDUCING = ["all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"]
MOVING = [
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
]
ALGO_DEPENDENT = ["all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
                  "all_gather", "all_gather_into_tensor"]


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def _ref_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int32 if dtype == torch.int16 else dtype  # gloo has no int16


def _ops_for(dtype: torch.dtype) -> list[str]:
    return OPS if _is_float(dtype) else [o for o in OPS if o != "AVG"]


def _kinds_for(dtype: torch.dtype, op: str) -> list[str]:
    """Input families for one (dtype, op): see the module docstring."""
    if op in ("SUM", "AVG") and _is_float(dtype):
        return ["int", "randn"]
    return {"SUM": ["sum"], "AVG": ["sum"], "PRODUCT": ["prod"], "MIN": ["minmax"], "MAX": ["minmax"]}[op]


class Runner:
    """Runs cases on both groups, compares, and keeps the differences as text."""

    def __init__(self, ctx: WorkerContext, gloo: dist.ProcessGroup, label: str):
        self.rank = ctx.rank
        self.ws = ctx.world_size
        self.gloo = gloo
        self.label = label
        self.case_no = 0
        self.checks = 0
        self.cases = 0
        self.lines: list[str] = []
        self.dropped = 0
        self.seconds: dict[str, float] = {}  # per collective, for tuning the matrix
        self.slowest: list[tuple[float, str]] = []
        self.broken = False  # the resilient group failed; later cases would only repeat it

    # -- inputs --------------------------------------------------------------------------------

    def gen(self, rank: int, salt: int = 0) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed((self.case_no * 131 + rank) * 977 + salt)
        return g

    def make(self, dtype: torch.dtype, n: int, kind: str, rank: int | None = None, salt: int = 0,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Deterministic input of `rank` (default: this rank) for the current case."""
        r = self.rank if rank is None else rank
        g = self.gen(r, salt)
        ws = self.ws
        shape = shape if shape is not None else (n,)
        if dtype == torch.bool:
            # biased towards True so that and-reductions over 8 ranks are not all False
            return torch.rand(shape, generator=g) < 0.75
        if kind == "prod":
            choices = torch.tensor([1, 1, 2] if dtype == torch.uint8 else [-1, 1, 1, 2])
            return choices[torch.randint(0, len(choices), shape, generator=g)].to(dtype)
        if _is_float(dtype):
            if kind in ("int", "sum"):
                return torch.randint(-8, 9, shape, generator=g).to(dtype)
            if kind == "randn":
                return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
            # minmax / data: any value, bitwise compared
            return (torch.randn(shape, generator=g, dtype=torch.float32) * 1000).to(dtype)
        info = torch.iinfo(dtype)
        if kind == "sum":  # large values, yet no overflow at any world size (int16 widening)
            hi = info.max // ws
            lo = 0 if info.min == 0 else -hi
            return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)
        # minmax / data: the whole range, every bit of every byte
        return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)

    # -- comparison ----------------------------------------------------------------------------

    def record(self, where: str, text: str) -> None:
        if len(self.lines) < MAX_LINES:
            self.lines.append(f"[{self.label}] rank {self.rank}: {where}: {text}")
        else:
            self.dropped += 1

    def compare(self, where: str, got: torch.Tensor, exp: torch.Tensor, bound: torch.Tensor | None = None) -> None:
        """Exact comparison, or |got - exp| <= bound element-wise when a bound is given."""
        self.checks += 1
        if got.shape != exp.shape or got.dtype != exp.dtype:
            self.record(where, f"got shape {tuple(got.shape)} {got.dtype}, expected {tuple(exp.shape)} {exp.dtype}")
            return
        if bound is None:
            if torch.equal(got, exp):
                return
            bad = (got != exp).reshape(-1)
        else:
            diff = (got.double() - exp.double()).abs().reshape(-1)
            bad = ~(diff <= bound.reshape(-1))  # NaN counts as bad
        if not bool(bad.any()):
            return
        idx = bad.nonzero().reshape(-1)
        i = int(idx[0])
        g, e = got.reshape(-1)[i].item(), exp.reshape(-1)[i].item()
        msg = f"{idx.numel()}/{got.numel()} elements differ; first at flat index {i}: got {g!r}, expected {e!r}"
        if bound is not None:
            msg += f" (allowed |diff| <= {float(bound.reshape(-1)[i]):.3g})"
        self.record(where, msg)

    def order_bound(self, x: torch.Tensor, exp: torch.Tensor, avg: bool) -> torch.Tensor:
        """Reduction-order tolerance for float SUM/AVG; needs sum_i |x_i| (one gloo all_reduce)."""
        eps = torch.finfo(x.dtype).eps
        absx = x.double().abs()
        dist.all_reduce(absx, group=self.gloo)
        bound = 2 * (self.ws - 1) * eps * absx
        if avg:
            bound = bound / self.ws
        return bound + eps * exp.double().abs()

    def ref(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(_ref_dtype(t.dtype)) if t.dtype == torch.int16 else t.clone()

    def run_case(self, where: str, fn, *args) -> None:
        if self.broken:
            return
        self.case_no += 1
        self.cases += 1
        t0 = time.monotonic()
        try:
            fn(where, *args)
        except Exception as e:  # noqa: BLE001  (one failing case must not hide the others)
            self.record(where, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            import resilient_comm

            err = resilient_comm.errored()
            if err is not None:
                self.broken = True
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                self.record("group", f"the group failed, later cases skipped: {first}")
        finally:
            name, dt = fn.__name__, time.monotonic() - t0
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
            self.slowest = sorted([*self.slowest, (round(dt, 3), where)], reverse=True)[:8]

    # -- reducing collectives ------------------------------------------------------------------

    def _reduce_ref_op(self, op: str):
        return REDUCE_OPS["SUM" if op == "AVG" else op]

    def _finish_ref(self, ref: torch.Tensor, dtype: torch.dtype, op: str) -> torch.Tensor:
        ref = ref.to(dtype)
        if op == "AVG":
            ref = ref / self.ws  # gloo SUM / world size, in the dtype itself
        return ref

    def _rop(self, op: str):
        return dist.ReduceOp.AVG if op == "AVG" else REDUCE_OPS[op]

    def all_reduce(self, where: str, dtype: torch.dtype, n: int, op: str, kind: str) -> None:
        x = self.make(dtype, n, kind)
        ours = x.clone()
        dist.all_reduce(ours, op=self._rop(op))
        ref = self.ref(x)
        dist.all_reduce(ref, op=self._reduce_ref_op(op), group=self.gloo)
        ref = self._finish_ref(ref, dtype, op)
        bound = self.order_bound(x, ref, op == "AVG") if kind == "randn" else None
        self.compare(where, ours, ref, bound)
        if kind == "randn" and self.ws > 1:
            # every rank holds the bitwise-same result
            everyone = [torch.empty_like(ours) for _ in range(self.ws)]
            dist.all_gather(everyone, ours, group=self.gloo)
            for r, t in enumerate(everyone):
                if not torch.equal(t.view(torch.uint8), ours.view(torch.uint8)):
                    self.record(where, f"rank {r}'s all_reduce result is not bitwise equal to this rank's")
                    break

    def reduce(self, where: str, dtype: torch.dtype, n: int, op: str, kind: str) -> None:
        root = self.case_no % self.ws
        x = self.make(dtype, n, kind)
        ours = x.clone()
        dist.reduce(ours, root, op=self._rop(op))
        ref = self.ref(x)
        dist.reduce(ref, root, op=self._reduce_ref_op(op), group=self.gloo)
        ref = self._finish_ref(ref, dtype, op)
        bound = self.order_bound(x, ref, op == "AVG") if kind == "randn" else None
        if self.rank == root:
            self.compare(f"{where} root={root}", ours, ref, bound)
        else:  # documented by the backend: non-root inputs are left unchanged
            self.compare(f"{where} root={root} (non-root input must stay unchanged)", ours, x)

    def reduce_scatter_tensor(self, where: str, dtype: torch.dtype, n: int, op: str, kind: str) -> None:
        x = self.make(dtype, n * self.ws, kind)
        ours = torch.zeros(n, dtype=dtype)
        dist.reduce_scatter_tensor(ours, x.clone(), op=self._rop(op))
        ref = torch.zeros(n, dtype=_ref_dtype(dtype))
        dist.reduce_scatter_tensor(ref, self.ref(x), op=self._reduce_ref_op(op), group=self.gloo)
        ref = self._finish_ref(ref, dtype, op)
        bound = None
        if kind == "randn":
            bound = self.order_bound(x, torch.zeros_like(x), op == "AVG")
            bound = bound.narrow(0, self.rank * n, n) + torch.finfo(dtype).eps * ref.double().abs()
        self.compare(where, ours, ref, bound)

    def reduce_scatter(self, where: str, dtype: torch.dtype, n: int, op: str, kind: str) -> None:
        x = self.make(dtype, n * self.ws, kind)
        ours = torch.zeros(n, dtype=dtype)
        dist.reduce_scatter(ours, [c.clone() for c in x.split(n)] if n else [x.clone() for _ in range(self.ws)],
                            op=self._rop(op))
        ref = torch.zeros(n, dtype=_ref_dtype(dtype))
        rx = self.ref(x)
        if self.ws <= 4:
            dist.reduce_scatter(ref, [c.clone() for c in rx.split(n)] if n else [rx.clone() for _ in range(self.ws)],
                                op=self._reduce_ref_op(op), group=self.gloo)
        else:
            # gloo's list reduce_scatter costs ~0.1 s a call at 8 ranks on 2 cores; its
            # reduce_scatter_tensor computes the same thing about 6x faster
            dist.reduce_scatter_tensor(ref, rx, op=self._reduce_ref_op(op), group=self.gloo)
        ref = self._finish_ref(ref, dtype, op)
        bound = None
        if kind == "randn":
            bound = self.order_bound(x, torch.zeros_like(x), op == "AVG")
            bound = bound.narrow(0, self.rank * n, n) + torch.finfo(dtype).eps * ref.double().abs()
        self.compare(where, ours, ref, bound)

    # -- data-movement collectives -------------------------------------------------------------

    def _sentinel(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, 77, dtype=dtype) if dtype != torch.bool else torch.zeros(shape, dtype=torch.bool)

    def broadcast(self, where: str, dtype: torch.dtype, n: int) -> None:
        root = self.case_no % self.ws
        x = self.make(dtype, n, "data")
        ours = x.clone()
        dist.broadcast(ours, root)
        ref = self.ref(x)
        dist.broadcast(ref, root, group=self.gloo)
        self.compare(f"{where} root={root}", ours, ref.to(dtype))

    def all_gather(self, where: str, dtype: torch.dtype, n: int) -> None:
        x = self.make(dtype, n, "data", shape=(n, 2))
        ours = [self._sentinel((n, 2), dtype) for _ in range(self.ws)]
        dist.all_gather(ours, x)
        ref = [self._sentinel((n, 2), _ref_dtype(dtype)) for _ in range(self.ws)]
        dist.all_gather(ref, self.ref(x), group=self.gloo)
        for i in range(self.ws):
            self.compare(f"{where} output[{i}]", ours[i], ref[i].to(dtype))

    def all_gather_into_tensor(self, where: str, dtype: torch.dtype, n: int) -> None:
        x = self.make(dtype, n, "data")
        ours = self._sentinel((n * self.ws,), dtype)
        dist.all_gather_into_tensor(ours, x)
        ref = self._sentinel((n * self.ws,), _ref_dtype(dtype))
        dist.all_gather_into_tensor(ref, self.ref(x), group=self.gloo)
        self.compare(where, ours, ref.to(dtype))

    def _split(self, src: int, dst: int, n: int) -> int:
        """Unequal per-pair element counts (zero included) derived from the size n."""
        if n == 0:
            return 0
        return ((src * 7 + dst * 3 + self.case_no) % 5) * max(1, n // 5) + (src + dst) % 2

    def all_to_all(self, where: str, dtype: torch.dtype, n: int, equal: bool) -> None:
        cnt = (lambda s, d: n) if equal else (lambda s, d: self._split(s, d, n))
        ins = [self.make(dtype, cnt(self.rank, d), "data", salt=d) for d in range(self.ws)]
        ours = [self._sentinel((cnt(s, self.rank),), dtype) for s in range(self.ws)]
        dist.all_to_all(ours, [t.clone() for t in ins])
        out_counts = [cnt(s, self.rank) for s in range(self.ws)]
        if equal:
            ref = [self._sentinel((c,), _ref_dtype(dtype)) for c in out_counts]
            dist.all_to_all(ref, [self.ref(t) for t in ins], group=self.gloo)
        else:
            # gloo's list all_to_all wants equal sizes; its all_to_all_single with the same
            # split sizes is the same exchange
            flat = self._sentinel((sum(out_counts),), _ref_dtype(dtype))
            dist.all_to_all_single(flat, self.ref(torch.cat(ins)), out_counts, [t.numel() for t in ins],
                                   group=self.gloo)
            ref = list(flat.split(out_counts))
        sizes = "equal" if equal else "unequal " + str([cnt(self.rank, d) for d in range(self.ws)])
        for i in range(self.ws):
            self.compare(f"{where} ({sizes}) output[{i}]", ours[i], ref[i].to(dtype))

    def all_to_all_single(self, where: str, dtype: torch.dtype, n: int, equal: bool) -> None:
        if equal:  # 1-D, n elements to every rank
            x = self.make(dtype, n * self.ws, "data")
            ours = self._sentinel((n * self.ws,), dtype)
            dist.all_to_all_single(ours, x.clone())
            ref = self._sentinel((n * self.ws,), _ref_dtype(dtype))
            dist.all_to_all_single(ref, self.ref(x), group=self.gloo)
            self.compare(f"{where} (equal split)", ours, ref.to(dtype))
            return
        # 2-D rows x 3, explicit unequal split sizes (in rows)
        in_splits = [self._split(self.rank, d, n) for d in range(self.ws)]
        out_splits = [self._split(s, self.rank, n) for s in range(self.ws)]
        x = self.make(dtype, 0, "data", shape=(sum(in_splits), 3))
        ours = self._sentinel((sum(out_splits), 3), dtype)
        dist.all_to_all_single(ours, x.clone(), out_splits, in_splits)
        ref = self._sentinel((sum(out_splits), 3), _ref_dtype(dtype))
        dist.all_to_all_single(ref, self.ref(x), out_splits, in_splits, group=self.gloo)
        self.compare(f"{where} (in_splits={in_splits} out_splits={out_splits})", ours, ref.to(dtype))

    def gather(self, where: str, dtype: torch.dtype, n: int) -> None:
        root = self.case_no % self.ws
        x = self.make(dtype, n, "data")
        me = self.rank == root
        ours = [self._sentinel((n,), dtype) for _ in range(self.ws)] if me else None
        dist.gather(x, ours, root)
        ref = [self._sentinel((n,), _ref_dtype(dtype)) for _ in range(self.ws)] if me else None
        dist.gather(self.ref(x), ref, root, group=self.gloo)
        if me:
            for i in range(self.ws):
                self.compare(f"{where} root={root} gather_list[{i}]", ours[i], ref[i].to(dtype))

    def scatter(self, where: str, dtype: torch.dtype, n: int) -> None:
        root = self.case_no % self.ws
        me = self.rank == root
        pieces = [self.make(dtype, n, "data", salt=i) for i in range(self.ws)] if me else None
        ours = self._sentinel((n,), dtype)
        dist.scatter(ours, [p.clone() for p in pieces] if me else None, root)
        ref = self._sentinel((n,), _ref_dtype(dtype))
        dist.scatter(ref, [self.ref(p) for p in pieces] if me else None, root, group=self.gloo)
        self.compare(f"{where} root={root}", ours, ref.to(dtype))

    # -- point to point, barrier, errors -------------------------------------------------------

    def p2p_ring(self, where: str, dtype: torch.dtype, sizes: list[int]) -> None:
        """Each rank sends several tagged messages to its right neighbour (isend/irecv, all
        posted before any wait), then one blocking send/recv pair (even ranks send first)."""
        ws, r = self.ws, self.rank
        right, left = (r + 1) % ws, (r - 1) % ws
        tags = [3 + 10 * k for k in range(len(sizes))]
        outs = {}
        for name, group in (("ours", None), ("gloo", self.gloo)):
            mine = [self.make(dtype, s, "data", salt=k) for k, s in enumerate(sizes)]
            got = [self._sentinel((s,), dtype) for s in sizes]
            works = [dist.isend(m, right, group=group, tag=t) for m, t in zip(mine, tags)]
            works += [dist.irecv(g, left, group=group, tag=t) for g, t in zip(got, tags)]
            for w in works:
                w.wait()
            one = self.make(dtype, sizes[-1], "data", salt=99)
            back = self._sentinel((sizes[-1],), dtype)
            if r % 2 == 0:
                dist.send(one, right, group=group, tag=7)
                dist.recv(back, left, group=group, tag=7)
            else:
                dist.recv(back, left, group=group, tag=7)
                dist.send(one, right, group=group, tag=7)
            outs[name] = [*got, back]
        # what the left neighbour sent, computed here from its deterministic inputs
        sent = [self.make(dtype, s, "data", rank=left, salt=k) for k, s in enumerate(sizes)]
        sent.append(self.make(dtype, sizes[-1], "data", rank=left, salt=99))
        for k in range(len(sizes) + 1):
            what = f"{where} message {k} from rank {left} (tag {tags[k] if k < len(sizes) else 7})"
            self.compare(f"{what} vs gloo", outs["ours"][k], outs["gloo"][k])
            self.compare(f"{what} vs sent", outs["ours"][k], sent[k])

    def barrier(self, where: str, rounds: int) -> None:
        """After barrier() returns, every rank must have reached it (keys set before it)."""
        store = dist.distributed_c10d._get_default_store()

        def keys(i: int) -> list[str]:
            return [f"barrier-check/{self.case_no}/{i}/{r}" for r in range(self.ws)]

        for i in range(rounds):
            if self.rank == i % self.ws:
                time.sleep(0.05)  # arrive last on purpose
            store.set(keys(i)[self.rank], "1")
            dist.barrier()
            self.checks += 1
            if not store.check(keys(i)):
                self.record(where, f"round {i}: barrier returned before every rank had reached it")

    def avg_on_int_raises(self, where: str) -> None:
        self.checks += 1
        try:
            dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG)
        except (ValueError, RuntimeError):
            return
        self.record(where, "all_reduce(int32, AVG) did not raise (gloo raises too)")

    def data_only_reduction_raises(self, where: str, dtype: torch.dtype) -> None:
        self.checks += 1
        try:
            dist.all_reduce(torch.ones(4, dtype=dtype))
        except ValueError as e:
            if "has no" not in str(e):
                self.record(where, f"all_reduce({dtype}) raised an unclear ValueError: {e}")
            return
        self.record(where, f"all_reduce({dtype}) did not raise a ValueError at the call")


def _matrix(run: Runner, cfg: dict) -> None:
    sizes = cfg["sizes"]
    colls = cfg["collectives"]
    large = cfg["large"]
    for dtype in cfg["dtypes"]:
        dn = str(dtype).replace("torch.", "")
        for n in sizes:
            for coll in colls:
                if coll in REDUCING and dtype in cfg.get("data_only_dtypes", ()):
                    continue
                if coll in REDUCING:
                    for op in _ops_for(dtype):
                        for kind in _kinds_for(dtype, op):
                            run.run_case(f"{coll} {dn} {op} n={n} {kind}", getattr(run, coll), dtype, n, op, kind)
                elif coll in ("all_to_all", "all_to_all_single"):
                    for equal in (True, False):
                        run.run_case(f"{coll} {dn} n={n}", getattr(run, coll), dtype, n, equal)
                else:
                    run.run_case(f"{coll} {dn} n={n}", getattr(run, coll), dtype, n)
    # ~3 MiB cases: (collective, dtype, op, kind)
    for coll, dtype, op, kind in large:
        dn = str(dtype).replace("torch.", "")
        n = LARGE_BYTES // dtype.itemsize
        if coll in ("reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                    "all_to_all", "all_to_all_single", "gather", "scatter"):
            n = max(1, n // run.ws)  # the total moved stays ~3 MiB
        where = " ".join(x for x in (coll, dn, op, f"n={n}", kind, "(large)") if x)
        if coll in REDUCING:
            run.run_case(where, getattr(run, coll), dtype, n, op, kind)
        elif coll in ("all_to_all", "all_to_all_single"):
            run.run_case(where, getattr(run, coll), dtype, n, kind == "equal")
        else:
            run.run_case(where, getattr(run, coll), dtype, n)


def _collectives_worker(ctx: WorkerContext, cfg: dict) -> dict:
    warnings.filterwarnings("ignore")  # deprecation notes of all_gather_into_tensor & co.
    for k, v in cfg["env"].items():
        os.environ[k] = v  # read by the communicator when init creates it
    start = time.monotonic()
    ctx.init(cfg.get("backend", "resilient_tcp"), timeout_s=OP_TIMEOUT_S)
    import datetime

    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=OP_TIMEOUT_S))
    run = Runner(ctx, gloo, cfg["label"])
    try:
        _matrix(run, cfg)
        if cfg.get("p2p") and ctx.world_size > 1:
            for dtype in cfg["dtypes"]:
                dn = str(dtype).replace("torch.", "")
                run.run_case(f"send/recv {dn}", run.p2p_ring, dtype, [0, 1, 1023])
        if cfg.get("extras"):
            run.run_case("barrier", run.barrier, 3)
            run.run_case("AVG on int32", run.avg_on_int_raises)
        if cfg.get("data_only_dtypes"):
            run.run_case("reduction of a data-only dtype", run.data_only_reduction_raises, cfg["data_only_dtypes"][0])
    except Exception:  # noqa: BLE001
        run.record("worker", "unexpected error:\n" + traceback.format_exc())
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    lines = run.lines + ([f"... and {run.dropped} more on rank {ctx.rank}"] if run.dropped else [])
    return {"lines": lines, "checks": run.checks, "cases": run.cases, "seconds": run.seconds, "slowest": run.slowest, "elapsed_s": time.monotonic() - start}


def _large_all(dtype_float: torch.dtype = torch.float32) -> list:
    """3 MiB cases: every collective once in float32, all_reduce in a few more dtypes."""
    f = dtype_float
    return [
        ("all_reduce", f, "SUM", "randn"),
        ("all_reduce", f, "MAX", "minmax"),
        ("all_reduce", torch.bfloat16, "AVG", "int"),
        ("all_reduce", torch.int64, "SUM", "sum"),
        ("all_reduce", torch.uint8, "MIN", "minmax"),
        ("reduce", f, "SUM", "int"),
        ("reduce_scatter", f, "SUM", "int"),
        ("reduce_scatter_tensor", f, "PRODUCT", "prod"),
        ("broadcast", f, None, None),
        ("all_gather", f, None, None),
        ("all_gather_into_tensor", f, None, None),
        ("all_to_all", f, None, "unequal"),
        ("all_to_all_single", f, None, "equal"),
        ("gather", f, None, None),
        ("scatter", f, None, None),
    ]


def _large_forced() -> list:
    return [
        ("all_reduce", torch.float32, "SUM", "randn"),
        ("all_reduce", torch.float16, "AVG", "int"),
        ("all_reduce", torch.int32, "MAX", "minmax"),
        ("reduce", torch.float32, "MIN", "minmax"),
        ("reduce", torch.float64, "AVG", "int"),
        ("reduce_scatter_tensor", torch.float32, "SUM", "randn"),
        ("reduce_scatter", torch.bool, "MIN", "minmax"),
        ("all_gather_into_tensor", torch.float32, None, None),
        ("all_gather", torch.uint8, None, None),
        ("broadcast", torch.float32, None, None),
    ]


def _run(cfg: dict, world_size: int, timeout_s: float) -> None:
    t0 = time.monotonic()
    results = run_workers(_collectives_worker, world_size, cfg, timeout_s=timeout_s)
    problems: list[str] = []
    checks = 0
    for res in results:
        if not res.ok:
            problems.append(f"rank {res.rank} failed (exit code {res.exitcode}): {res.error}")
            continue
        problems.extend(res.value["lines"])
        checks += res.value["checks"]
    assert not problems, (
        f"{cfg['label']}: {cfg.get('backend', 'resilient_tcp')} differs from gloo in {len(problems)} place(s) "
        f"(wall {time.monotonic() - t0:.1f}s):\n" + "\n".join(problems)
    )
    assert checks > 0, "no comparison ran"
    v = results[0].value
    print(f"{cfg['label']}: {checks} comparisons over {world_size} ranks, {v['cases']} cases, worker "
          f"{v['elapsed_s']:.1f}s, wall {time.monotonic() - t0:.1f}s; slowest cases on rank 0: {v['slowest'][:3]}")


def _reduced(label: str, env: dict) -> dict:
    """The reduced matrix: fewer dtypes and sizes, every collective and op still."""
    return {
        "label": label,
        "env": env,
        "dtypes": REDUCED_DTYPES,
        "sizes": [0, 1, 1023],
        "collectives": REDUCING + MOVING,
        "large": _large_all()[:1] + [c for c in _large_all() if c[0] != "all_reduce"],
        "p2p": True,
        "extras": True,
    }


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size,data_path", [(2, "shm"), (3, "shm"), (4, "shm"), (4, "socket")],
                         indirect=["data_path"])
def test_full_matrix(world_size: int, data_path: str) -> None:
    """Every collective x every dtype x every op, sizes 0, 1, 7, 1023 and ~3 MiB; auto algorithm."""
    cfg = {
        "label": f"full ws={world_size} algo=auto",
        "env": {},
        "dtypes": ALL_DTYPES,
        "sizes": [0, 1, 7, 1023],
        "collectives": REDUCING + MOVING,
        "large": _large_all(),
        "p2p": True,
        "extras": True,
    }
    _run(cfg, world_size, timeout_s=140)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size,data_path", [(1, "shm"), (5, "shm"), (8, "shm"), (5, "socket")],
                         indirect=["data_path"])
def test_reduced_matrix(world_size: int, data_path: str) -> None:
    """Fewer dtypes and sizes at world sizes 1, 5 and 8 (every collective and op still)."""
    _run(_reduced(f"reduced ws={world_size} algo=auto", {}), world_size, timeout_s=140)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [5, 8])
def test_lazy_connections_matrix(world_size: int) -> None:
    """The reduced matrix with connections made on first use (all but the ring neighbours)."""
    _run(_reduced(f"lazy ws={world_size} algo=auto", {"RESILIENT_COMM_TCP_FULL_MESH": "2"}), world_size,
         timeout_s=140)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "algo,world_size,chunk,data_path",
    [
        ("ring", 3, None, "shm"),
        ("ring", 3, None, "socket"),
        ("rd", 3, None, "shm"),  # not a power of two: ranks 0/1 fold into one before recursive doubling
        ("rd", 4, None, "shm"),
        ("rd", 6, None, "shm"),  # two folded pairs around a power of two
        ("ring", 4, "1000", "shm"),  # many pipelined chunks; 1000 bytes splits elements across broadcast chunks
    ],
    indirect=["data_path"],
)
def test_forced_algorithm(algo: str, world_size: int, chunk: str | None, data_path: str) -> None:
    """RESILIENT_COMM_ALGO forces one algorithm family for every size, small and ~3 MiB."""
    env = {"RESILIENT_COMM_ALGO": algo}
    if chunk:
        env["RESILIENT_COMM_CHUNK_BYTES"] = chunk
    cfg = {
        "label": f"forced ws={world_size} algo={algo}" + (f" chunk={chunk}" if chunk else ""),
        "env": env,
        "dtypes": FORCED_DTYPES,
        "sizes": [1, 7, 1023] if world_size <= 4 and not chunk else [7, 1023],
        "collectives": ALGO_DEPENDENT,
        "large": _large_forced() if world_size <= 4 and not chunk else _large_forced()[:3],
        "p2p": False,
        "extras": False,
    }
    _run(cfg, world_size, timeout_s=140)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_emulated_nccl_matrix(world_size: int) -> None:
    """The reduced matrix on the NCCL code path (RESILIENT_COMM_NCCL_EMULATE=1), world sizes 1-5
    and 8 (odd, even, powers of two and not; 6 and 7 added nothing but minutes); at 2 ranks every kernel lasts 1 ms, so results are read only once the stream got there."""
    env = {"RESILIENT_COMM_NCCL_EMULATE": "1"}
    if world_size == 2:
        env["RESILIENT_COMM_NCCL_EMULATE_KERNEL_US"] = "1000"
    cfg = {
        "label": f"emulated nccl ws={world_size}",
        "backend": "resilient_nccl",
        "env": env,
        "dtypes": REDUCED_DTYPES,
        "data_only_dtypes": [torch.int16],
        "sizes": [0, 1, 1023],
        "collectives": REDUCING + MOVING,
        "large": _large_all()[:1] + [c for c in _large_all() if c[0] != "all_reduce"],
        "p2p": True,
        "extras": True,
    }
    _run(cfg, world_size, timeout_s=140)


# ----------------------------------------------------------------------------------------------
# Large simultaneous exchange
# ----------------------------------------------------------------------------------------------

P2P_TIMEOUT_S = 8.0  # per-op deadline of both groups in the exchange test
EXCHANGE_BOUND_S = 2.0  # the exchange takes ~50 ms on either backend; a stall till the deadline is a deadlock


def _exchange_round(r: int, peer: int, i: int, gap: float, numel: int, gloo, ours) -> list[str]:
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * i + r))
    expect = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * i + peer))
    what = (f"rank {r} round {i}: isend {numel * 4} bytes to rank {peer}, "
            f"{'then irecv at once' if not gap else f'irecv {gap * 1000:.0f} ms later'}, "
            f"while rank {peer} does the same")
    lines: list[str] = []
    got = {}
    for name, group in (("gloo", gloo), ("resilient_tcp", ours)):
        buf = torch.zeros(numel)
        t0 = time.monotonic()
        try:
            s = dist.isend(mine, peer, group=group, tag=100 + i)
            if gap:
                time.sleep(gap)
            q = dist.irecv(buf, peer, group=group, tag=100 + i)
            s.wait()
            q.wait()
        except Exception as e:  # noqa: BLE001
            lines.append(f"{what}: {name} failed after {time.monotonic() - t0:.1f}s: "
                         f"{type(e).__name__}: {str(e).splitlines()[0]}")
            return lines
        took = time.monotonic() - t0
        got[name] = buf
        if took > EXCHANGE_BOUND_S:
            lines.append(f"{what}: {name} took {took:.1f}s (op timeout {P2P_TIMEOUT_S:.0f}s, "
                         f"bound {EXCHANGE_BOUND_S:.0f}s): stalled until the deadline")
    if not torch.equal(got["resilient_tcp"], got["gloo"]) or not torch.equal(got["resilient_tcp"], expect):
        lines.append(f"{what}: received bytes differ from gloo's / the sender's")
    return lines


def _exchange_worker(ctx: WorkerContext, numel: int, gaps: list[float]) -> dict:
    """Pairs (0,1), (2,3), ...: both sides isend a large tensor, then irecv the peer's, then
    wait on both; round i leaves gaps[i] seconds between posting the isend and the irecv (work
    a program may do in between). Both backends must finish it promptly, and resilient_tcp must
    deliver gloo's bytes (the sender's)."""
    import datetime

    ctx.init("resilient_tcp", timeout_s=P2P_TIMEOUT_S)
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=P2P_TIMEOUT_S))
    lines: list[str] = []
    peer = ctx.rank ^ 1
    for i, gap in enumerate(gaps):
        # a fresh group each round: new connections whose socket buffers have not grown yet
        # (after one large transfer the kernel enlarges them, which can hide a stall)
        ours = dist.new_group(backend="resilient_tcp", timeout=datetime.timedelta(seconds=P2P_TIMEOUT_S))
        dist.all_reduce(torch.ones(1), group=ours)  # connected and ready
        if peer < ctx.world_size:
            lines += _exchange_round(ctx.rank, peer, i, gap, numel, gloo, ours)
        stop = torch.tensor([1 if lines else 0])
        dist.all_reduce(stop, group=gloo)  # also: every pair finished this round
        dist.destroy_process_group(ours)
        if stop.item():
            break  # a stall costs a whole op timeout; the first round that shows one is enough
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    return {"lines": lines}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size,data_path", [(2, "shm"), (4, "shm"), (2, "socket")], indirect=["data_path"])
def test_simultaneous_large_isend_irecv(world_size: int, data_path: str) -> None:
    """A ~4 MiB float32 tensor each way, both ranks isend first: must not deadlock or stall.
    Each round runs on a fresh group. Back-to-back rounds race the backend's worker thread
    (isend taken alone or together with the irecv); the round with a 20 ms gap makes it take
    the isend alone."""
    numel = P2P_LARGE_BYTES // 4
    results = run_workers(_exchange_worker, world_size, numel, [0.0, 0.0, 0.02], timeout_s=80)
    problems = []
    for res in results:
        if not res.ok:
            problems.append(f"rank {res.rank} failed: {res.error}")
        else:
            problems.extend(res.value["lines"])
    assert not problems, "simultaneous large isend/irecv exchange:\n" + "\n".join(problems)
