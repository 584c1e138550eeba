#!/usr/bin/env bash
# What only a GPU shows, in one short run (a lent GPU machine: `run` of the device tool; see CONTRIBUTING.md):
#   1. the ring's block kernels on CUDA (flash for bf16, memory-efficient for fp32) against whole-sequence attention;
#   2. benchmarks/runtime/bench_gpu.py: galva-hp against a plain PyTorch loop, DDP and FSDP2, ~1B Llama-style model, bf16;
#   3. where a one-rank process's base goes (benchmarks/costmodel/gpu_base.py); a launch-bound layer timed
#      three ways (benchmarks/costmodel/gpu_layer_timing.py); the model profile's CUDA tests
#      (layers, attention cores, vocabulary and experts timed on the GPU, the bytes the CPU's); and
#      `galva-profile model --max-tp 2` (tp ranks forked from the CPU-only bytes process);
#   4. `galva run --quick` end to end on the GPU (NCCL, bf16), its check stage's measured against predicted.
# Logs and the updated benchmark README go to $OUT (default /tmp/gpu-checks). Wheels in .whl/ are installed first
# when present: the project's pins of transformers, megatron-core and pydantic (the GPU image has its own versions or
# none), and the pure-Python galva distributions (their entry points: galva-ckpt finds the model families through
# one). `bash tools/gpu_checks.sh --wheels`, run here beforehand, builds the galva ones into .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --wheels ]]; then
  mkdir -p .whl && rm -f .whl/galva*.whl
  for d in packages/*/; do
    [[ $d == *galva-search/ ]] && continue  # its C++ core is built on the GPU machine
    "${GALVA_VENV:-.venv}/bin/pip" wheel -q --no-deps --no-build-isolation -w .whl "$d"
  done
  ls .whl
  exit 0
fi
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/galva-site .whl/*.whl
fi
SRC=$(ls -d "$PWD"/packages/*/src | paste -sd:)
export PYTHONPATH=$SRC:/tmp/galva-site  # the sources first; the wheels give the entry points
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
# galva-search's C++ core for the run in step 3, built while steps 1 and 2 run
( $PY -m pip install -q --no-deps --no-build-isolation --target /tmp/galva-search packages/galva-search \
  >"$OUT/build.log" 2>&1; echo "build exit $?" >>"$OUT/build.log" ) &
builder=$!
step() { echo "== $1 ($(date +%T))"; }
steps=" ${GALVA_GPU_STEPS:-blocks bench profile run} "  # a subset, to rerun one check in a short lease
if [[ $steps == *" blocks "* ]]; then
step "ring blocks on CUDA"
timeout 150 $PY -m pytest -q -p no:cacheprovider packages/galva-hp/tests/test_attention_blocks_devices.py 2>&1 \
  | tail -15 | tee "$OUT/blocks.log"
fi
if [[ $steps == *" bench "* ]]; then
step "bench_gpu"
timeout 400 $PY benchmarks/runtime/bench_gpu.py --write-readme 2>&1 | tail -20 | tee "$OUT/bench_gpu.log"
cp benchmarks/runtime/README.md "$OUT/runtime-README.md"
fi
if [[ $steps == *" profile "* ]]; then
step "model profile on CUDA"
timeout 60 $PY benchmarks/costmodel/gpu_base.py 2>&1 | grep -v Warn | tail -4 | tee "$OUT/gpu_base.log"
timeout 90 $PY benchmarks/costmodel/gpu_layer_timing.py 2>&1 | grep -v Warn | tail -12 | tee "$OUT/layer_timing.log"
timeout 180 $PY -m pytest -q -p no:cacheprovider packages/galva-profiler/tests/test_model.py -k "cuda or experts" 2>&1 \
  | tail -15 | tee "$OUT/profile.log"
timeout 120 $PY -m galva_profiler.cli model --preset tiny-llama --seq-lengths 16 --max-tp 2 --quick --timing-span 0 \
  --quiet -o /tmp/galva-tp2.json 2>&1 | tail -4 | tee -a "$OUT/profile.log"
fi
wait "$builder"
tail -3 "$OUT/build.log"
export PYTHONPATH=/tmp/galva-search:$SRC:/tmp/galva-site
if [[ $steps == *" run "* ]]; then
step "galva run --quick"
timeout "${GALVA_RUN_TIMEOUT:-240}" $PY -m galva.cli run --quick --force --out /tmp/galva-run 2>&1 | tee "$OUT/run.log" | tail -40
for f in /tmp/galva-run/check.json /tmp/galva-run/run.json; do [[ -f $f ]] && cp "$f" "$OUT/"; done
fi
step "done"
