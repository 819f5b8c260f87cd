#!/usr/bin/env bash
# GPU suite + benchmarks in one go on a CUDA machine (our H200 through the device tool).
#
#   bash scripts/gpu_suite.sh [admit|tests|kernels|flux|drift|all ...]     (default: all)
#
# Installs carried wheels from .whl/ (the device has torch/triton but no diffusers) into
# /tmp/site, then per phase: admission of the close kernels on FLUX.1-dev-size activations
# (bench/admit.py, writes ditfuse/contracts/admission_results.json), the GPU tests (tests/gpu),
# the per-kernel benchmark, the FLUX step benchmark and the 28-step drift run. Output goes to
# $OUT (or out/gpu): suite.log with everything printed, plus the CSV/JSON/PNG results (at most 8
# files, the device tool's limit). Per-phase time limits: *_TIMEOUT variables.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
LOG="$OUT/suite.log"
: > "$LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 DITFUSE_CACHE="${DITFUSE_CACHE:-/tmp/ditfuse-cache}" OUT
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import torch, triton
print("gpu", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
try:
    import diffusers; print("diffusers", diffusers.__version__)
except Exception as e:
    print("diffusers missing:", e)
PY
phases=("$@"); [ ${#phases[@]} -eq 0 ] && phases=(all)
status=0
summary=()
run_phase() {  # name timeout cmd...
  local name=$1 limit=$2; shift 2
  echo "=== $name ===" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -E "^\s*(warnings.warn|_warn_once)" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ $rc -ne 0 ] && status=$rc
  summary+=("$name: rc=$rc in $((SECONDS - t0))s")
}
want() { for p in "${phases[@]}"; do [[ $p == "$1" || $p == all ]] && return 0; done; return 1; }
want admit && run_phase admit "${ADMIT_TIMEOUT:-120}" python3 bench/admit.py --layers 2 2
if want tests; then
  run_phase tests "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu ${PYTEST_ARGS:-}
  summary+=("  tests: $(grep -E '(passed|failed)' "$LOG" | tail -n 1)")
fi
want kernels && run_phase kernels "${KERNELS_TIMEOUT:-200}" python3 bench/bench_kernels.py --out "$OUT/kernels_h200.csv" ${DITFUSE_COMMIT:+--commit $DITFUSE_COMMIT} ${KERNELS_ARGS:-}
want flux && run_phase flux "${FLUX_TIMEOUT:-400}" python3 -m ditfuse.runtime.cli bench flux --out-dir "$OUT" ${FLUX_ARGS:-}
want drift && run_phase drift "${DRIFT_TIMEOUT:-300}" python3 -m ditfuse.runtime.cli drift --model flux-dev-size --transformer-only --steps 28 --size 1024x1024 --out-dir "$OUT" ${DRIFT_ARGS:-}
echo "== summary ==" | tee -a "$LOG"
printf '%s\n' "${summary[@]}" | tee -a "$LOG"
exit $status
