#!/usr/bin/env bash
# Every test: lint, then pytest over packages/*/tests and tests/. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GALVA_VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest "$@"
