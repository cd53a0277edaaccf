"""The README's commands exist: every `meshnet <command> [sub] --flag` it shows is a command
and a flag of that command (checked against docs/cli.md, which test_cli_reference keeps equal to
the argparse definitions), and every repository file it names exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()


def _segments(text: str) -> list[str]:
    """Each code block line (continuations joined) and each inline code span."""
    out: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        out += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    out += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    return out


def _cli_sections() -> dict[str, str]:
    """docs/cli.md's help text per command path ("up", "tracker unquarantine", ...)."""
    parts = re.split(r"^#{2,3} meshnet ?(.*)$", CLI_DOC, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _invocations() -> list[tuple[str, list[str]]]:
    """(command path, flags) for each `meshnet ...` the README shows."""
    sections = _cli_sections()
    found = []
    for seg in _segments(README):
        for m in re.finditer(r"(?:^|[\s/])meshnet ([a-z]+)((?: [^|;&#]*)?)", seg):
            try:
                words = shlex.split(m.group(2))
            except ValueError:
                words = m.group(2).split()
            path = m.group(1)
            if words and f"{path} {words[0]}" in sections:
                path = f"{path} {words[0]}"
            flags = [w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][a-z0-9-]*(=\S*)?", w)]
            found.append((path, flags))
    return found


def test_readme_commands_and_flags_exist() -> None:
    sections = _cli_sections()
    invocations = _invocations()
    assert any(path == "up" for path, _ in invocations), "the README shows no `meshnet up`"
    for path, flags in invocations:
        assert path in sections, f"README shows `meshnet {path}`: no such command in docs/cli.md"
        for flag in flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", sections[path]), (
                f"README shows `meshnet {path} {flag}`, which `meshnet {path} --help` does not list")


def test_readme_names_only_files_that_exist() -> None:
    names = set(re.findall(r"\]\(([^)#:]+)\)", README))
    names |= set(re.findall(r"(?<![\w/.])((?:docs|bench|tests|scripts|tracker|gateway|nodes|wire|schemas|"
                            r"artifacts|validator|meshnet|bus)/[\w./-]+\.(?:md|py|sh|png))", README))
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert not missing, f"README names files that do not exist: {missing}"
