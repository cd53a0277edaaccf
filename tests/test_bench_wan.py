"""bench/wan.py's quick configuration runs end to end (so the WAN benchmark does not rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_wan_quick_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.wan", "--quick", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert [(r["hops"], r["rtt_ms"]) for r in rows] == [(2, 0.0), (2, 20.0)]
    far = rows[1]
    assert far["errors"] == 0 and far["stream_tps"] > 0 and far["aggregate_tps_c2"] > 0
    # a stream cannot beat its floor by much, and RTT 20 ms costs at least one-way x hops per token
    assert far["added_ms_per_token"] >= 2 * 10.0 * 0.9
