"""bench/speculative.py runs end to end on a small configuration (so the speculative benchmark
does not rot): every figure the issue asks for is there, for both prompt sets, with the
self-draft baseline from the same run, and every answer is the plain one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("tps", "baseline_tps", "speedup", "acceptance", "accepted_per_trip", "identical_to_baseline")


def test_bench_speculative_small_run_reports_every_figure() -> None:
    cmd = [sys.executable, "-m", "bench.speculative", "--json", "--rtt-ms", "20", "--hops", "2",
           "--decode", "16", "--concurrency", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    [row] = report["rows"]
    assert (row["hops"], row["rtt_ms"]) == (2, 20.0)
    for name in ("copy", "free"):
        figures = row[name]
        assert all(k in figures for k in (*KEYS, "aggregate_speedup_c2")), figures.keys()
        assert figures["identical_to_baseline"] and figures["identical_c2"] and not figures["errors"]
        self_draft = figures["self_draft"]
        assert all(k in self_draft for k in KEYS) and self_draft["identical_to_baseline"]
        # the target drafting for itself keeps (nearly) every draft: the mechanism's ceiling
        assert self_draft["acceptance"] is not None and self_draft["acceptance"] > 0.9, self_draft
    assert row["copy"]["acceptance"] is not None  # prompt lookup drafted on the copies
