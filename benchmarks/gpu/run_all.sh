#!/usr/bin/env bash
# Runtime controls on one GPU (H100/H200): occupancy caps and stream priority.
#
#   benchmarks/gpu/run_all.sh            # on a GPU machine, < 8 minutes
#   benchmarks/gpu/run_all.sh --dry-run  # anywhere: builds and checks all but the timings
#
# 1. builds the runtime library (libjax_overlap_rt.so) with the system compiler;
# 2. validates the plans used here;
# 3. builds overlap_bench.cu with nvcc for sm_90 (ptxas -v gives each kernel's registers)
#    and runs its sweep under the runtime library: compute kind (cuBLAS GEMM, a loop
#    fusion with many blocks per SM, an attention-like tile kernel) x cap (none, 1, 2, 4)
#    x priority (off, on) x issue order (compute or copy launched first), each beside an
#    NCCL-channel-sized copy on a second stream, random inputs; the library's counters
#    and the kernel names it saw are recorded, and a configuration meant to shape that
#    shaped nothing fails the run;
#    launch_gaps.cu measures the gap from one kernel's end to the next one's start, on one
#    stream and on a second stream behind an event, launched and from a CUDA graph (the
#    simulator's launch_overhead_s and event_latency_s);
#    gemm_dispatch.cu measures when an NCCL-channel-sized copy starts behind cuBLASLt's
#    GEMM at several SM-count targets (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), with and
#    without priority, in either order, and how many SMs the GEMM's grid leaves free,
#    once as launched and once under CUDA_DEVICE_MAX_CONNECTIONS=1;
# 4. fits the simulator's constants to the sweep (sim.calibrate reads the output as is);
# 5. checks that a jitted JAX program gives identical outputs with and without shaping
#    (jax_check.py, under `jax-overlap launch`), with shaped launches > 0 on a GPU;
# 6. writes benchmarks/results/runtime_<gpu>_<date>.json.
# The dry run does 1, 2, the nvcc build, the sweep's configurations without timings
# (`overlap_bench --list`), fills them with the simulator's predictions (marked as
# such in every record) and calibrates on them (the round trip), the JAX check on CPU
# under the library, and a launch through the fake driver of the test suite; it
# writes build/gpu_bench/overlap_bench.json, no results file, and exits 0.
set -euo pipefail

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
  esac
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"; else PY=python3; fi
fi
BUILD="${BUILD_DIR:-$REPO/build/gpu_bench}"
RESULTS="$REPO/benchmarks/results"
mkdir -p "$BUILD"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()
note() { echo "[run_all] $*" >&2; SUMMARY+=("$*"); }
T0=$SECONDS

# 1. Runtime library.
LIB="$("$PY" -c 'from jax_overlap._src.runtime import library; print(library.library_path())')"
note "runtime library: $LIB"

# 2. Plans.
for plan in "$HERE"/plan_*.json; do
  "$PY" -c 'import sys; from jax_overlap.runtime import Plan; Plan.from_json(sys.argv[1])' "$plan"
  note "plan ok: $(basename "$plan")"
done

# 3. The CUDA benchmark.
HAVE_GPU=0
CHECK_FAILED=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; fi
if [[ $DRY_RUN -eq 0 && $HAVE_GPU -eq 0 ]]; then
  echo "run_all.sh: no GPU found (nvidia-smi -L failed); use --dry-run" >&2; exit 1
fi
BENCH="$BUILD/overlap_bench"
if ! command -v nvcc >/dev/null 2>&1; then
  echo "run_all.sh: nvcc not found; install the CUDA toolkit" >&2; exit 1
fi
nvcc -O3 -std=c++17 -arch=sm_90 -Xptxas -v -o "$BENCH" "$HERE/overlap_bench.cu" -ldl \
  > "$BUILD/ptxas.log" 2>&1 || { cat "$BUILD/ptxas.log" >&2; exit 1; }
note "built overlap_bench (nvcc, sm_90; registers from ptxas -v)"
GAPS="$BUILD/launch_gaps"
nvcc -O3 -std=c++17 -arch=sm_90 -o "$GAPS" "$HERE/launch_gaps.cu" > "$BUILD/launch_gaps_build.log" 2>&1 \
  || { cat "$BUILD/launch_gaps_build.log" >&2; exit 1; }
GAPS_JSON="$BUILD/launch_gaps.json"
DISPATCH="$BUILD/gemm_dispatch"
nvcc -O3 -std=c++17 -arch=sm_90 -o "$DISPATCH" "$HERE/gemm_dispatch.cu" -ldl \
  > "$BUILD/gemm_dispatch_build.log" 2>&1 || { cat "$BUILD/gemm_dispatch_build.log" >&2; exit 1; }
DISPATCH_JSON="$BUILD/gemm_dispatch.json"
DISPATCH_ONE_JSON="$BUILD/gemm_dispatch_max_connections_1.json"

# cuBLAS from the pip wheels jax's CUDA plugin installs, if not on the system path.
CUBLAS_DIR="$("$PY" - <<'EOF' 2>/dev/null || true
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
  for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcublas.so*"), recursive=True)):
    print(os.path.dirname(path)); sys.exit(0)
EOF
)"
BENCH_JSON="$BUILD/overlap_bench.json"
RECORDS=("$PY" "$HERE/records.py")
if [[ $DRY_RUN -eq 1 ]]; then
  GPU_KEY=h100
  "$BENCH" --list --out "$BENCH_JSON" >/dev/null
  "$GAPS" --list --out "$GAPS_JSON" >/dev/null
  note "$("${RECORDS[@]}" gaps "$GAPS_JSON" "$GPU_KEY")"
  "$DISPATCH" --list --out "$DISPATCH_JSON" >/dev/null
  note "$("${RECORDS[@]}" dispatch "$DISPATCH_JSON")"
  note "SKIP overlap_bench run: dry run (timings need an H100/H200); configurations listed"
  "${RECORDS[@]}" resources "$BENCH_JSON" "$BUILD/ptxas.log" "$GPU_KEY" >&2
  "${RECORDS[@]}" dry-run "$BENCH_JSON" "$GPU_KEY" >&2
else
  GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)"
  case "$(echo "$GPU_NAME" | tr 'A-Z' 'a-z')" in
    *h200*) GPU_KEY=h200 ;; *h100*) GPU_KEY=h100 ;; *a100*) GPU_KEY=a100 ;;
    *) echo "run_all.sh: $GPU_NAME is not in the catalogue (h100, h200, a100)" >&2; exit 1 ;;
  esac
  LD_LIBRARY_PATH="${CUBLAS_DIR:+$CUBLAS_DIR:}${LD_LIBRARY_PATH:-}" LD_PRELOAD="$LIB" \
    JAX_OVERLAP_RT_VERBOSE=2 timeout 300 "$BENCH" --out "$BENCH_JSON" >/dev/null \
    2> "$BUILD/runtime.log" || { tail -n 20 "$BUILD/runtime.log" >&2; exit 1; }
  note "overlap_bench done: $BENCH_JSON"
  timeout 60 "$GAPS" --out "$GAPS_JSON" >/dev/null || { echo "run_all.sh: launch_gaps failed" >&2; exit 1; }
  note "$("${RECORDS[@]}" gaps "$GAPS_JSON" "$GPU_KEY")"
  # A failed GEMM probe is reported and leaves the rest of the run standing.
  run_dispatch() {  # OUT_JSON [VAR=VALUE ...]
    local out="$1"; shift
    env "$@" LD_LIBRARY_PATH="${CUBLAS_DIR:+$CUBLAS_DIR:}${LD_LIBRARY_PATH:-}" \
      timeout 90 "$DISPATCH" --out "$out" >/dev/null 2> "$out.log" \
      && note "$("${RECORDS[@]}" dispatch "$out")" \
      || { note "gemm_dispatch $* failed: $(tail -n 3 "$out.log" | tr '\n' ' ')"; echo '{}' > "$out"; }
  }
  run_dispatch "$DISPATCH_JSON"
  run_dispatch "$DISPATCH_ONE_JSON" CUDA_DEVICE_MAX_CONNECTIONS=1
  "${RECORDS[@]}" resources "$BENCH_JSON" "$BUILD/ptxas.log" "$GPU_KEY" >&2
  "${RECORDS[@]}" names "$BENCH_JSON" "$BUILD/runtime.log" >&2
  # A configuration meant to shape that shaped nothing fails the run, after the JAX check
  # and with the results written (marked), so that one call to a GPU shows everything.
  "${RECORDS[@]}" check "$BENCH_JSON" >&2 || CHECK_FAILED=1
fi

# 4. Calibration reads the output as it is.
note "$("${RECORDS[@]}" calibrate "$BENCH_JSON" "$GPU_KEY")"

# 5. JAX check: identical outputs with and without shaping.
JAX_ENV=(env)
if [[ $DRY_RUN -eq 1 || $HAVE_GPU -eq 0 ]]; then
  JAX_ENV+=(JAX_PLATFORMS=cpu)
  note "JAX check on CPU (no kernel launches to shape; checks the preload path and regions)"
fi
XLA_CHECK_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true"
[[ $DRY_RUN -eq 1 || $HAVE_GPU -eq 0 ]] && XLA_CHECK_FLAGS="${XLA_FLAGS:-}"
"${JAX_ENV[@]}" XLA_FLAGS="$XLA_CHECK_FLAGS" timeout 240 "$PY" "$HERE/jax_check.py" run "$BUILD/plain.npz" \
  > "$BUILD/jax_plain.json"
"${JAX_ENV[@]}" XLA_FLAGS="$XLA_CHECK_FLAGS" JAX_OVERLAP_RT_VERBOSE=2 timeout 240 "$PY" -c \
  'import sys; from jax_overlap._src.runtime.launch import main; sys.exit(main(sys.argv[1:]))' \
  --plan "$HERE/plan_shape_all.json" -- "$PY" "$HERE/jax_check.py" run "$BUILD/shaped.npz" \
  > "$BUILD/jax_shaped.json" 2> "$BUILD/jax_shaped.log" || { tail -n 20 "$BUILD/jax_shaped.log" >&2; exit 1; }
"$PY" "$HERE/jax_check.py" compare "$BUILD/plain.npz" "$BUILD/shaped.npz" >&2
note "JAX check: identical outputs; shaped run: $(tail -n1 "$BUILD/jax_shaped.json")"
# The same program with cuBLAS's SM-count target on XLA's GEMMs: counted, outputs compared.
"${JAX_ENV[@]}" XLA_FLAGS="$XLA_CHECK_FLAGS" JAX_OVERLAP_RT_VERBOSE=2 timeout 240 "$PY" -c \
  'import sys; from jax_overlap._src.runtime.launch import main; sys.exit(main(sys.argv[1:]))' \
  --plan "$HERE/plan_library_gemms.json" -- "$PY" "$HERE/jax_check.py" run "$BUILD/gemms.npz" \
  > "$BUILD/jax_gemms.json" 2> "$BUILD/jax_gemms.log" || { tail -n 20 "$BUILD/jax_gemms.log" >&2; exit 1; }
GEMMS_SAME="$("$PY" "$HERE/jax_check.py" compare "$BUILD/plain.npz" "$BUILD/gemms.npz" \
  "cuBLAS's SM-count target")" || true
note "JAX check, library GEMMs: $GEMMS_SAME; run: $(tail -n1 "$BUILD/jax_gemms.json")"

# Dry run: one launch through the test suite's fake driver, to see shaping act.
if [[ $DRY_RUN -eq 1 ]]; then
  FAKE="$BUILD/fake_cuda"
  mkdir -p "$FAKE"
  cc -O1 -fPIC -shared -Wl,-Bsymbolic -Wl,-soname,libcuda.so.1 -o "$FAKE/libcuda.so.1" \
    "$REPO/xla_patches/testing/fake_cuda.c" -lpthread
  cc -O1 -o "$FAKE/fake_app" "$REPO/xla_patches/testing/fake_app.c" -ldl -lpthread
  OUT="$(LD_LIBRARY_PATH="$FAKE" LD_PRELOAD="$LIB" FAKE_CUDA_FUNCS="gemm_fusion_1:static=1024:regs=32" \
    JAX_OVERLAP_RT_RULES="$("$PY" -c 'from jax_overlap.runtime import Plan; print(Plan(kernels=[{"match": "gemm_*", "blocks_per_sm": 2}]).to_rules(), end="")')" \
    "$FAKE/fake_app" dlopen launch:gemm_fusion_1:256:0 klaunch:gemm_fusion_1:256:0 | tail -n1)"
  echo "$OUT" | grep -q '"launches_shaped": 2' || { echo "run_all.sh: fake-driver launches were not shaped: $OUT" >&2; exit 1; }
  note "fake driver: an XLA-like dlopen launch and a CUDA-runtime-like CUkernel launch shaped (launches_shaped=2)"
  cc -O1 -fPIC -shared -o "$FAKE/libcublas_fake.so" "$REPO/xla_patches/testing/fake_cublas.c"
  OUT="$(LD_LIBRARY_PATH="$FAKE" LD_PRELOAD="$LIB" \
    JAX_OVERLAP_RT_RULES="$("$PY" -c 'from jax_overlap.runtime import Plan; print(Plan.from_json("'"$HERE/plan_library_gemms.json"'").to_rules(), end="")')" \
    "$FAKE/fake_app" dlopen "cublas:$FAKE/libcublas_fake.so" "cublaslt:$FAKE/libcublas_fake.so")"
  echo "$OUT" | grep -q '"gemm_handles_targeted": 1' && echo "$OUT" | grep -q '"gemm_descs_targeted": 1' \
    || { echo "run_all.sh: the fake cuBLAS was not given the SM-count target: $OUT" >&2; exit 1; }
  note "fake cuBLAS: a handle and a cuBLASLt descriptor created through dlsym given the plan's SM-count target (66)"
  note "dry run done in $((SECONDS - T0)) s; sweep output $BENCH_JSON; no results written"
  exit 0
fi

# 6. Results.
mkdir -p "$RESULTS"
SLUG="$(echo "$GPU_NAME" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '_' | sed 's/_$//')"
DATE="$(date -u +%Y-%m-%d)"
RESULT="$RESULTS/runtime_${SLUG}_${DATE}.json"
"$PY" - "$BENCH_JSON" "$BUILD/jax_plain.json" "$BUILD/jax_shaped.json" "$RESULT" "$GPU_NAME" "$CHECK_FAILED" "$GAPS_JSON" "$DISPATCH_JSON" "$DISPATCH_ONE_JSON" "$BUILD/jax_gemms.json" "$GEMMS_SAME" <<'EOF'
import datetime, json, subprocess, sys
bench, plain, shaped, out, gpu, check_failed, gaps, dispatch, dispatch_one, gemms, gemms_same = sys.argv[1:]
import jax
shaped_run = json.loads(open(shaped).read().splitlines()[-1])
shaped_none = shaped_run["launches_shaped"] + shaped_run["graph_nodes_shaped"] == 0
result = json.load(open(bench))
result.update({
  "gpu": gpu,
  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True).stdout.strip(),
  "jax": jax.__version__,
  "jax_check": {"identical": True, "plain": json.loads(open(plain).read().splitlines()[-1]),
                "shaped": shaped_run,
                "library_gemms": json.loads(open(gemms).read().splitlines()[-1]),
                "library_gemms_outputs": gemms_same},
  "shaping_check_failed": check_failed == "1",
  "launch_gaps": json.load(open(gaps)),
  "gemm_dispatch": [json.load(open(dispatch)), json.load(open(dispatch_one))],
})
json.dump(result, open(out, "w"), indent=1)
print(out)
if shaped_none:
  sys.exit("run_all.sh: the JAX program under the shaping plan shaped no launch")
EOF
note "results: $RESULT ($((SECONDS - T0)) s)"
if [[ $CHECK_FAILED -eq 1 ]]; then
  echo "run_all.sh: configurations meant to shape shaped nothing (records.py check)" >&2
  exit 1
fi
