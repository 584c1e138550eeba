#!/usr/bin/env bash
# One command from a fresh clone: a project virtual environment (.venv) with every distribution (the seven
# stages and `galva`, the end-to-end pipeline) installed editable. On machines without an NVIDIA GPU, torch is pinned to its CPU build through constraints/cpu.txt.
#   bash tools/setup.sh            # then: bash tools/test.sh
# Environment: PYTHON (interpreter for the venv, default python3), GALVA_VENV (default .venv),
#              GALVA_CONSTRAINTS (override the constraints file).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${GALVA_VENV:-.venv}
start=$SECONDS

if [[ -n "${GALVA_CONSTRAINTS:-}" ]]; then
  constraints=$GALVA_CONSTRAINTS
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  constraints=constraints/gpu.txt
else
  constraints=constraints/cpu.txt
fi
echo "[setup] venv $VENV, constraints $constraints"

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# byte-compiled at install (pip's default): where PYTHONDONTWRITEBYTECODE is set (this project's machines set it),
# Python keeps no bytecode of its own, and every process would compile torch's and transformers' modules again
pip=("$VENV/bin/python" -m pip --disable-pip-version-check install -q -c "$constraints")

# torch first: anything that lets pip choose it freely would pull the CUDA build on a CPU machine; the build
# backends with it, as the editable installs below build with them (--no-build-isolation).
"${pip[@]}" torch numpy -r requirements/dev.txt
"${pip[@]}" --no-build-isolation \
  -e packages/galva-schema \
  -e packages/galva-comm \
  -e packages/galva-search \
  -e packages/galva-profiler \
  -e packages/galva-hp \
  -e packages/galva-models \
  -e packages/galva-ckpt \
  -e packages/galva
echo "[setup] done in $((SECONDS - start)) s; run the tests with: bash tools/test.sh"
