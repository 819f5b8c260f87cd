#!/usr/bin/env bash
# GPU suite + benchmarks in one go on a CUDA machine (our H200 through the device tool).
#
#   bash scripts/gpu_suite.sh [tests|kernels|flux|all ...]     (default: all)
#
# Installs carried wheels from .whl/ (the device has torch/triton but no diffusers) into
# /tmp/site, runs the GPU tests (tests/gpu, marker gpu), the per-kernel benchmark and the FLUX
# step benchmark, and writes everything under $OUT (or out/gpu). The last lines are a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 DITFUSE_CACHE="${DITFUSE_CACHE:-/tmp/ditfuse-cache}"
python3 - <<'PY' | tee "$OUT/env.txt"
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
for ph in "${phases[@]}"; do
  if [[ $ph == tests || $ph == all ]]; then
    timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
    rc=${PIPESTATUS[0]}; [ $rc -ne 0 ] && status=$rc
    summary+=("gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")")
  fi
  if [[ $ph == kernels || $ph == all ]]; then
    timeout ${KERNELS_TIMEOUT:-200} python3 bench/bench_kernels.py --out "$OUT/kernels_h200.csv" ${DITFUSE_COMMIT:+--commit $DITFUSE_COMMIT} 2>&1 | tee "$OUT/bench_kernels.log"
    rc=${PIPESTATUS[0]}; [ $rc -ne 0 ] && status=$rc
    summary+=("kernel bench rc=$rc")
  fi
  if [[ $ph == flux || $ph == all ]]; then
    timeout ${FLUX_TIMEOUT:-400} python3 -m ditfuse.runtime.cli bench flux --out-dir "$OUT" ${FLUX_ARGS:-} 2>&1 | tee "$OUT/bench_flux.log"
    rc=${PIPESTATUS[0]}; [ $rc -ne 0 ] && status=$rc
    summary+=("flux bench rc=$rc")
  fi
done
echo "== summary =="
printf '%s\n' "${summary[@]}"
exit $status
