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
    # the floor takes the run's own hop compute (> 0) and one trip round the route (hops x one-way)
    assert far["hop_compute_ms"] > 0 and 0.5 < far["stream_vs_floor"] <= 1.05, far


def test_rounds_report_each_settings_median_and_keep_every_round() -> None:
    from bench.wan import medians

    def row(rtt: float, tps: float, errors: int = 0) -> dict[str, object]:
        return {"hops": 2, "rtt_ms": rtt, "errors": errors, "tokens": [1, 2], "stream_tps": tps,
                "added_vs_hops_x_one_way": None if rtt == 0 else tps / 10}

    rounds = [[row(0.0, 50.0), row(20.0, 20.0)], [row(0.0, 40.0, 1), row(20.0, 26.0)],
              [row(0.0, 45.0), row(20.0, 21.0)]]
    near, far = medians(rounds)
    assert (near["rtt_ms"], near["stream_tps"], near["errors"]) == (0.0, 45.0, 1)
    assert near["added_vs_hops_x_one_way"] is None and far["added_vs_hops_x_one_way"] == 2.1
    assert far["stream_tps"] == 21.0 and far["tokens"] == [1, 2]
    assert [r["stream_tps"] for r in far["runs"]] == [20.0, 26.0, 21.0]  # type: ignore[index]
    assert "runs" not in medians(rounds[:1])[0]
