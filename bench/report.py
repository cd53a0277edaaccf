"""How a benchmark prints its report: one JSON object (`--json`), or one `key: value` line each."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def print_report(report: dict[str, Any], *, as_json: bool, width: int, skip: Collection[str] = ()) -> None:
    """Print `report`; the plain form leaves out the keys in `skip` (per-run detail)."""
    if as_json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if key not in skip:
            print(f"{key:>{width}}: {value}")
