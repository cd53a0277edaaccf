"""Dependency direction: each plane imports only the planes its row of ALLOWED names (README.md, "Documentation")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "schemas": {"schemas"},
    "bus": {"schemas", "bus"},
    "wire": {"schemas", "wire"},  # the activation transport: nodes and the gateway share it
    "artifacts": {"schemas", "artifacts"},
    "tracker": {"schemas", "bus", "tracker"},
    "nodes": {"schemas", "bus", "wire", "artifacts", "nodes"},
    "gateway": {"schemas", "bus", "wire", "artifacts", "gateway"},
    # a client of the mesh like the gateway (its route client), with a whole-model engine
    "validator": {"schemas", "bus", "wire", "artifacts", "gateway", "nodes", "validator"},
}
PLANES = set(ALLOWED) | {"meshnet"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & PLANES


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_plane_imports_only_allowed_packages(package: str) -> None:
    bad = {}
    for path in (ROOT / package).rglob("*.py"):
        extra = _imports(path) - ALLOWED[package]
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"forbidden cross-plane imports: {bad}"
