#!/usr/bin/env bash
# Every GPU check in one call, each step's output kept even when a step fails:
#
#   benchmarks/gpu/session.sh OUT_DIR
#
# 1. run_all.sh: the runtime controls (occupancy caps, stream priority) on the GPU and the
#    JAX program under shaping;
# 2. model_check.py: the cost model's kernel estimates against measured kernels, as XLA
#    runs the step (command buffers on) and once more with command buffers off (every
#    kernel, cuBLAS's too, then carries its HLO instruction in the trace).
# 3. measured_selection.py: @overlap(select="measure") on a one-device step, its variants
#    timed on the GPU beside the cost model's estimates.
# Each step has its own time limit (RUN_ALL_TIMEOUT, MODEL_TIMEOUT, MODEL_NOCB_TIMEOUT,
# MEASURED_TIMEOUT) so
# that the whole call fits one device command (under 10 minutes).
# Writes to OUT_DIR: gpu.txt (nvidia-smi, jax), model.json, model.log, model_nocb.json,
# model_nocb.log, measured_selection.json, measured_selection.log, run_all.log, the run's runtime_<gpu>_<date>.json, runtime.log (the
# library's log of the sweep, last 2 MB), jax_shaped.log (the library's log of the JAX
# check) and ptxas.log.
set -uo pipefail
OUT_DIR="${1:?usage: session.sh OUT_DIR}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
T0=$SECONDS
{ nvidia-smi; nvidia-smi -q -d CLOCK | head -n 40; "$PY" -c 'import jax; print(jax.__version__, jax.devices())'; } \
  > "$OUT_DIR/gpu.txt" 2>&1
PYTHON="$PY" timeout "${RUN_ALL_TIMEOUT:-250}" bash "$HERE/run_all.sh" > "$OUT_DIR/run_all.log" 2>&1
echo "[session] run_all rc=$? at $((SECONDS - T0)) s"
timeout "${MODEL_TIMEOUT:-120}" "$PY" "$HERE/model_check.py" run "$OUT_DIR/model.json" \
  > "$OUT_DIR/model.log" 2>&1
echo "[session] model_check rc=$? at $((SECONDS - T0)) s"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "${MODEL_NOCB_TIMEOUT:-130}" \
  "$PY" "$HERE/model_check.py" run "$OUT_DIR/model_nocb.json" --sizes large,large+scan_remat \
  --no-deviceless > "$OUT_DIR/model_nocb.log" 2>&1
echo "[session] model_check (no command buffers) rc=$? at $((SECONDS - T0)) s"
timeout "${MEASURED_TIMEOUT:-90}" "$PY" "$HERE/measured_selection.py" \
  "$OUT_DIR/measured_selection.json" > "$OUT_DIR/measured_selection.log" 2>&1
echo "[session] measured_selection rc=$? at $((SECONDS - T0)) s"
cp "$REPO"/benchmarks/results/runtime_*_"$(date -u +%Y-%m-%d)".json "$OUT_DIR/" 2>/dev/null
tail -c 2000000 "$REPO/build/gpu_bench/runtime.log" > "$OUT_DIR/runtime.log" 2>/dev/null
tail -c 2000000 "$REPO/build/gpu_bench/jax_shaped.log" > "$OUT_DIR/jax_shaped.log" 2>/dev/null
cp "$REPO/build/gpu_bench/ptxas.log" "$OUT_DIR/" 2>/dev/null
tail -n 5 "$OUT_DIR/model.log" "$OUT_DIR/model_nocb.log" "$OUT_DIR/measured_selection.log" \
  "$OUT_DIR/run_all.log"
echo "[session] done in $((SECONDS - T0)) s"
