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
# 4. model_check.py on training steps as users write them (optax's AdamW in a plain
#    jax.jit step with unrolled blocks, and a Flax nn.scan(nn.remat(Block)) step): the
#    deviceless estimate and the same compile's against the measured step.
# Each step has its own time limit (RUN_ALL_TIMEOUT, MODEL_TIMEOUT, MODEL_NOCB_TIMEOUT,
# MEASURED_TIMEOUT, USER_TIMEOUT; USER_SIZES the sizes of step 4). SESSION_STEPS chooses the steps (default all:
# "run_all model model_nocb measured user"); all of them take about 12 minutes, more than
# one device command, so run them in two calls, e.g. SESSION_STEPS="run_all model" then
# SESSION_STEPS="model_nocb measured user".
# Writes to OUT_DIR: gpu.txt (nvidia-smi, jax), model.json, model.log, model_nocb.json,
# model_user.json, model_user.log,
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
STEPS=" ${SESSION_STEPS:-run_all model model_nocb measured user} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
if want run_all; then
  PYTHON="$PY" timeout "${RUN_ALL_TIMEOUT:-250}" bash "$HERE/run_all.sh" > "$OUT_DIR/run_all.log" 2>&1
  echo "[session] run_all rc=$? at $((SECONDS - T0)) s"
fi
if want model; then
  timeout "${MODEL_TIMEOUT:-120}" "$PY" "$HERE/model_check.py" run "$OUT_DIR/model.json" \
    > "$OUT_DIR/model.log" 2>&1
  echo "[session] model_check rc=$? at $((SECONDS - T0)) s"
fi
if want model_nocb; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "${MODEL_NOCB_TIMEOUT:-130}" \
    "$PY" "$HERE/model_check.py" run "$OUT_DIR/model_nocb.json" --sizes large,large+scan_remat \
    --no-deviceless > "$OUT_DIR/model_nocb.log" 2>&1
  echo "[session] model_check (no command buffers) rc=$? at $((SECONDS - T0)) s"
fi
if want measured; then
  timeout "${MEASURED_TIMEOUT:-90}" "$PY" "$HERE/measured_selection.py" \
    "$OUT_DIR/measured_selection.json" > "$OUT_DIR/measured_selection.log" 2>&1
  echo "[session] measured_selection rc=$? at $((SECONDS - T0)) s"
fi
if want user; then
  timeout "${USER_TIMEOUT:-150}" "$PY" "$HERE/model_check.py" run "$OUT_DIR/model_user.json" \
    --sizes "${USER_SIZES:-large+adamw,large+flax_scan_remat}" > "$OUT_DIR/model_user.log" 2>&1
  echo "[session] model_check (training steps as users write them) rc=$? at $((SECONDS - T0)) s"
fi
cp "$REPO"/benchmarks/results/runtime_*_"$(date -u +%Y-%m-%d)".json "$OUT_DIR/" 2>/dev/null
tail -c 2000000 "$REPO/build/gpu_bench/runtime.log" > "$OUT_DIR/runtime.log" 2>/dev/null
tail -c 2000000 "$REPO/build/gpu_bench/jax_shaped.log" > "$OUT_DIR/jax_shaped.log" 2>/dev/null
cp "$REPO/build/gpu_bench/ptxas.log" "$OUT_DIR/" 2>/dev/null
for log in model model_nocb model_user measured_selection run_all; do
  [[ -f "$OUT_DIR/$log.log" ]] && tail -n 5 "$OUT_DIR/$log.log"
done
echo "[session] done in $((SECONDS - T0)) s"
