"""`resilient-comm chaos --kinds flap,slow-link`: link faults on several nodes (network
namespaces on a bridge, etcd), one trial of each: a link down for less than the tolerated
outage and a link limited to a few tens of Mbit/s cost nothing (no decision, no fence, no
eviction) and every rank ends bit-identical to a fault-free run on the same nodes. Skipped,
with the reason, where namespaces or etcd are not available."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from resilient_comm.tools import chaos_nodes

WHY = chaos_nodes.unavailable("flap") or chaos_nodes.unavailable("slow-link")


@pytest.mark.skipif(WHY is not None, reason=f"link faults: {WHY}")
@pytest.mark.timeout(420)
def test_a_flapping_link_and_a_slow_link_cost_nothing(tmp_path: Any) -> None:
    out = tmp_path / "chaos.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "resilient_comm.tools.cli", "chaos", "--trials", "2", "--seed", "3",
                           "--kinds", "flap,slow-link", "--steps", "24", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=400)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.splitlines()[-4:]
    assert table[0].split()[:3] == ["kind", "trials", "ok"] and table[-1].split()[:3] == ["all", "2", "2"], table
    trials = json.loads(out.read_text())["trials"]
    assert [t["kind"] for t in trials] == ["flap", "slow-link"]
    for t in trials:
        assert t["ok"] and t["status"] == 0 and not t["hang"] and not t["false_evictions"] and not t["recovery_ms"], t
        assert t["seconds"] < 120, f"{t['kind']} took {t['seconds']:.0f} s"
    # The limit slowed the steps it lasted for: "N steps while it lasted (median X ms), else median Y ms".
    link = trials[1]["note"]
    under, otherwise = (float(link.split(part)[1].split(" ms")[0]) for part in ("(median ", "else median "))
    assert under > 1.5 * otherwise, link
    print(f"[chaos] {took:.0f} s; flap: {trials[0]['note']}; slow-link: {link}")
