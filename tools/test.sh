#!/usr/bin/env bash
# Every test: lint (ruff), type-check (mypy, every distribution) and pytest over packages/*/tests and tests/.
# Extra arguments go to pytest. mypy runs beside pytest at the lowest CPU priority, its report printed after the
# tests': from a cold cache (a fresh clone) it is ~85 s of CPU, which the serial tests leave idle on the second core
# (most of them use one); at nice 19 it yields the cores to the multi-rank tests. Any failure fails the script.
# GALVA_TEST_WORKERS=N runs the tests in N pytest-xdist workers. The default is one (this process, in order): on the
# 2-core CI machine two workers gave no gain (the whole CI 30 min 46 s, 55 CPU-minutes; each multi-rank test 2-3 times
# slower beside another) and timing-sensitive tests (the watchdog, measured weight shares) grew flaky.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GALVA_VENV:-.venv}
workers=${GALVA_TEST_WORKERS:-1}
"$VENV/bin/ruff" check .
typing=$(mktemp)
nice -n 19 "$VENV/bin/mypy" packages/galva-schema/src packages/galva-comm/src packages/galva-search/src \
  packages/galva-hp/src packages/galva-models/src packages/galva-profiler/src packages/galva-ckpt/src \
  packages/galva/src >"$typing" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$typing"' EXIT
parallel=()
if (( workers > 1 )); then
  parallel=(-n "$workers" --dist worksteal)
fi
tests=0
"$VENV/bin/python" -m pytest "${parallel[@]}" "$@" || tests=$?
typed=0
wait "$mypy_pid" || typed=$?
cat "$typing"
if (( tests != 0 )); then
  exit "$tests"
fi
exit "$typed"
