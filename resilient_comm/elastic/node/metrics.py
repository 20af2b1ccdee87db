"""A node's Prometheus metrics: ``resilient-run --metrics-port N`` serves them at
``http://<host>:N/metrics`` (the ``prometheus_client`` package: ``pip install
'resilient_comm[metrics]'``).

The node's agent (its ``resilient-run``) holds them. Its workers tell it what only they know
over the connection they beat on: a finished recovery (one ``rec`` line per recovery and
process: cause, first evidence, world size, phase durations; `model.channel.recovery_line`) and that is
all: an op error is counted by the recovery it starts. The agent adds what it sees itself:
its processes' heartbeat lag and the spares it runs that wait for a place. Every series is
per node; a scrape of every node's endpoint gives the job's (sum the counters, take the
maximum lag).
"""

from __future__ import annotations

import logging
from typing import Any

from resilient_comm.elastic.model.channel import parse_recovery
from resilient_comm.elastic.model.timeline import SOURCES

log = logging.getLogger("resilient_comm.elastic")

# Recovery phase durations span ~1 ms (an abort) to minutes (a checkpoint load).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class MetricsError(RuntimeError):
    """The metrics cannot be served: no prometheus_client, or the port cannot be bound."""


class NodeMetrics:
    """The node's series, in a registry of their own, served over HTTP from a thread of
    prometheus_client's. `port` 0: any free port (`port` then says which)."""

    def __init__(self, node: int, port: int, addr: str = "0.0.0.0", world: int = 0) -> None:
        try:
            import prometheus_client as pc
        except ImportError as e:
            raise MetricsError(
                "--metrics-port needs the prometheus_client package: pip install 'resilient_comm[metrics]'"
            ) from e
        r = self.registry = pc.CollectorRegistry()
        self.recoveries = pc.Counter(
            "resilient_comm_recoveries",
            "In-process recoveries finished by this node's processes (one per process), by cause",
            ["cause"],
            registry=r,
        )
        self.phases = pc.Histogram(
            "resilient_comm_recovery_phase_seconds",
            "Duration of each phase of a recovery (docs/elastic.md, Timeline), and the total",
            ["phase"],
            buckets=BUCKETS,
            registry=r,
        )
        self.detected_by = pc.Counter(
            "resilient_comm_detections",
            "Recoveries by the first evidence that reached the process",
            ["source"],
            registry=r,
        )
        self.op_errors = pc.Counter(
            "resilient_comm_op_errors",
            "Collective errors that started a recovery, by kind",
            ["kind"],
            registry=r,
        )
        self.world = pc.Gauge(
            "resilient_comm_world_size", "Members of the epoch this node's processes applied last", registry=r
        )
        self.spares = pc.Gauge(
            "resilient_comm_spares_waiting", "Hot spares on this node waiting for a place", registry=r
        )
        self.lag = pc.Gauge(
            "resilient_comm_heartbeat_lag_seconds",
            "Time since the agent last heard each of its processes",
            ["rank"],
            registry=r,
        )
        self.outages = pc.Histogram(
            "resilient_comm_store_outage_seconds",
            "Store outages this node's agent rode out (no answer, then answered again before it "
            "fenced): a flapping link, an election",
            buckets=BUCKETS,
            registry=r,
        )
        self.world.set(world)
        for s in SOURCES:
            self.detected_by.labels(s)  # every source shows, at 0 until seen
        try:
            started = pc.start_http_server(port, addr=addr, registry=r)
        except OSError as e:  # the port is taken, or not ours to bind
            raise MetricsError(
                f"--metrics-port {port}: cannot serve the metrics at {addr}:{port}: {e}"
            ) from e
        server = started[0] if isinstance(started, tuple) else None
        self._server: Any = server
        self.port = server.server_port if server is not None else port
        log.info("node %d: metrics at http://%s:%d/metrics", node, addr, self.port)

    def recovery(self, fields: list[str]) -> None:
        """A worker's ``rec`` line (its fields after the word); ValueError if malformed."""
        cause, op_error, source, world, phases = parse_recovery(fields)
        self.recoveries.labels(cause).inc()
        if op_error != "-":
            self.op_errors.labels(op_error).inc()
        if source != "-":
            self.detected_by.labels(source).inc()
        if world:
            self.world.set(world)
        for name, s in phases.items():
            self.phases.labels(name).observe(s)

    def heartbeats(self, lags: dict[int, float], spares_waiting: int) -> None:
        for rank, lag in lags.items():
            self.lag.labels(str(rank)).set(round(lag, 3))
        self.spares.set(spares_waiting)

    def outage(self, seconds: float) -> None:
        self.outages.observe(seconds)

    def forget(self, rank: int) -> None:
        """A process that ended: its lag series goes."""
        try:
            self.lag.remove(str(rank))
        except KeyError:
            pass

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


__all__ = ["MetricsError", "NodeMetrics"]
