"""docs/cli.md is generated from the argparse definitions and must match them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_is_current() -> None:
    done = subprocess.run([sys.executable, "scripts/cli_reference.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        "docs/cli.md does not match the commands' flags. Re-run "
        "`.venv/bin/python scripts/cli_reference.py` and commit docs/cli.md.\n" + done.stderr)


def test_cli_reference_names_every_command() -> None:
    from meshnet.cli import COMMANDS

    text = (ROOT / "docs" / "cli.md").read_text()
    for name in COMMANDS:
        assert f"## meshnet {name}\n" in text, f"docs/cli.md has no section for `meshnet {name}`"
