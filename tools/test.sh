#!/usr/bin/env bash
# Every test: lint (ruff), type-check (mypy, every distribution), then pytest over
# packages/*/tests and tests/. Extra arguments go to pytest.
# Tests run in up to 4 pytest-xdist workers, one per core (GALVA_TEST_WORKERS=1 runs them in this process, in order):
# a multi-rank test waits on its ranks' start, rendezvous and messages a good part of its time, and a test beside it
# uses that time (on 2 cores the suite ran at about two thirds of the cores' time in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GALVA_VENV:-.venv}
cores=$(nproc 2>/dev/null || echo 1)
workers=${GALVA_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
"$VENV/bin/ruff" check .
"$VENV/bin/mypy" packages/galva-schema/src packages/galva-comm/src packages/galva-search/src packages/galva-hp/src packages/galva-models/src packages/galva-profiler/src packages/galva-ckpt/src packages/galva/src
parallel=()
if (( workers > 1 )); then
  parallel=(-n "$workers" --dist worksteal)
fi
"$VENV/bin/python" -m pytest "${parallel[@]}" "$@"
