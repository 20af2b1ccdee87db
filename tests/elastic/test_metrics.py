"""resilient-run --metrics-port: a Prometheus endpoint whose series move during a recovery."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from resilient_comm.elastic.model.channel import parse_recovery, recovery_line
from resilient_comm.elastic.model.timeline import Timeline

pytest.importorskip("prometheus_client", reason="--metrics-port needs prometheus_client (resilient_comm[metrics])")


def _samples(text: str) -> dict[str, float]:
    """'name{labels}' -> value of every sample in a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def _scrape(port: int) -> dict[str, float]:
    with _DIRECT.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return _samples(r.read().decode())


@pytest.mark.timeout(90)
def test_the_metrics_endpoint_counts_a_recovery_while_the_job_runs(tmp_path: pathlib.Path) -> None:
    """4 workers, rank 1 SIGKILLs itself at step 5: the survivors' three recoveries show as
    counters by cause and first evidence, as one observation per phase in the histograms, and
    the world size drops from 4 to 3, while the job is still training."""
    cmd = [sys.executable, "-m", "resilient_comm.elastic", "--nproc-per-node", "4", "--metrics-port", "0",
           "-m", "resilient_comm.testing.toy", "--steps", "80", "--step-ms", "40", "--kill", "1:5:synced",
           "--events", str(tmp_path)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    port_seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "/metrics" in line:
                port_seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert port_seen.wait(30), "".join(lines)
        m = re.search(r"metrics at http://[^:]+:(\d+)/metrics", "".join(lines))
        assert m, "".join(lines)
        port = int(m.group(1))
        before = _scrape(port)
        assert before["resilient_comm_world_size"] == 4.0, before
        assert before.get('resilient_comm_detections_total{source="op_error"}') == 0.0, before
        deadline, after = time.monotonic() + 30, before
        while time.monotonic() < deadline and proc.poll() is None:
            after = _scrape(port)
            if sum(v for k, v in after.items() if k.startswith("resilient_comm_recoveries_total")) >= 3:
                break
            time.sleep(0.05)  # polling the endpoint, as a scraper does
        assert proc.poll() is None, "the job ended before its recovery was scraped: " + "".join(lines)
        recoveries = {k: v for k, v in after.items() if k.startswith("resilient_comm_recoveries_total")}
        assert sum(recoveries.values()) == 3, (recoveries, "".join(lines))
        assert after["resilient_comm_world_size"] == 3.0, after
        detections = sum(after[f'resilient_comm_detections_total{{source="{s}"}}']
                         for s in ("op_error", "exit_report", "suspicion"))
        assert detections == 3, after
        for phase in ("detected", "aborted", "agreed", "rebuilt", "restored", "first_commit", "total"):
            assert after[f'resilient_comm_recovery_phase_seconds_count{{phase="{phase}"}}'] == 3, (phase, after)
        total = after['resilient_comm_recovery_phase_seconds_sum{phase="total"}'] / 3
        assert 0 < total < 5.0, f"mean recovery {total:.3f} s"
        lags = {k: v for k, v in after.items() if k.startswith("resilient_comm_heartbeat_lag_seconds")}
        assert set(lags) == {f'resilient_comm_heartbeat_lag_seconds{{rank="{r}"}}' for r in (0, 2, 3)}, lags
        assert all(0 <= v < 2.0 for v in lags.values()), lags
        assert after["resilient_comm_spares_waiting"] == 0.0
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_recovery_line_round_trips_and_bad_ones_are_refused() -> None:
    tl = Timeline(2, "PeerFailureError: rank 1 hung up", members=[0, 2, 3])
    for i, p in enumerate(("failure", "detected", "aborted", "agreed", "rebuilt", "restored", "first_commit")):
        tl.mark(p, 100.0 + 0.01 * i)
    tl.via, tl.op_error = {"exit_report": 100.02, "op_error": 100.005}, "PeerFailureError"
    line = recovery_line(tl)
    assert len(line) < 1024 and line.isascii() and "\n" not in line
    cause, kind, source, world, phases = parse_recovery(line.split()[1:])
    assert (cause, kind, source, world) == ("PeerFailureError", "PeerFailureError", "op_error", 3)
    assert phases["total"] == pytest.approx(0.06) and phases["detected"] == pytest.approx(0.01)
    for bad in (["x"], ["c", "k", "nowhere", "3"], ["c", "k", "-", "-1"], ["c", "k", "-", "3", "total=-1"],
                ["c", "k", "-", "3", "lunch=0.1"], ["c d", "k", "-", "3"]):
        with pytest.raises(ValueError):
            parse_recovery(bad)
