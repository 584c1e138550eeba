#!/usr/bin/env bash
# The README's main command: set the project up (tools/setup.sh, the same setup the test command relies on), then
# run the whole job on this machine with `galva run`: corpus and tokenizer made locally, profile hardware and a
# small Llama-style model, search a plan under a memory budget, train it with a checkpoint, export it to Hugging
# Face format, load the export with transformers and generate, and write one HTML report.
#   bash tools/quickstart.sh                       # outputs in galva-run/ (replaced if it exists)
#   bash tools/quickstart.sh --quick               # the CI variant (4 layers, 8 steps)
#   bash tools/quickstart.sh --memory 4GB --nproc 2 --train-iters 80 --num-layers 4 ...   # any `galva run` flag
# Environment: GALVA_SKIP_SETUP=1 skips the setup when .venv is already there; GALVA_VENV as in tools/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GALVA_VENV:-.venv}
start=$SECONDS
if [[ "${GALVA_SKIP_SETUP:-0}" != 1 || ! -x "$VENV/bin/galva" ]]; then
  bash tools/setup.sh
fi
setup_s=$((SECONDS - start))
"$VENV/bin/galva" run --force "$@"
echo "quickstart: setup ${setup_s} s, pipeline $((SECONDS - start - setup_s)) s, total $((SECONDS - start)) s"
