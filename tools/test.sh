#!/usr/bin/env bash
# Every test: lint (ruff), type-check (mypy, every distribution), then pytest over
# packages/*/tests and tests/. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GALVA_VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/mypy" packages/galva-schema/src packages/galva-comm/src packages/galva-search/src packages/galva-hp/src packages/galva-models/src packages/galva-profiler/src packages/galva-ckpt/src packages/galva/src
"$VENV/bin/python" -m pytest "$@"
