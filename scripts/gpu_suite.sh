#!/usr/bin/env bash
# GPU suite + benchmarks in one go on a CUDA machine (our H200 through the device tool).
#
#   bash scripts/gpu_suite.sh [probes|tests|admit|kernels|vae|vaekl|vaeflux2|vaeqwen|wan22vae|wanvae|flux|wan|flux2|flux3|chroma|sd3|qwenimage|zimage|qwenimage21|hunyuanvideo|hunyuanvideo15|drift|parallel|all ...]     (default: all)
#
# Installs carried wheels from .whl/ (the device has torch/triton but no diffusers) into
# /tmp/site, then per phase:
#   probes   torch's RMS order at Wan widths, SDPA backends, host cost per call  -> suite.log
#   tests    the GPU tests (tests/gpu, bitwise)                                   -> suite.log
#   admit    admission of every close kernel on FLUX/Wan activations              -> admission_results.json
#   kernels  per-kernel eager / torch.compile / ours, flush + graph timing        -> kernels_h200.csv
#   vae      GroupNorm(+SiLU) kernels at the VAE decoder shapes, then vaekl, vaeflux2, vaeqwen, wan22vae and wanvae -> group_norm_h200.csv
#   vaekl    AutoencoderKL decode (1024x1024, 2048x2048) + breakdown -> vae_{decode,breakdown}_h200.csv
#   vaeflux2 AutoencoderKLFlux2 decode (the FLUX.2 / FLUX.3 VAE; 1024, 2048) -> flux2_vae_{decode,breakdown}_h200.csv
#   vaeqwen  AutoencoderKLQwenImage decode (Qwen-Image's VAE, 1024 images)  -> qwenimage_vae_{decode,breakdown}_h200.csv
#   wan22vae the Wan 2.2 TI2V-5B VAE decode (704x1280x17)          -> wan22_vae_{decode,breakdown}_h200.csv
#   wanvae   AutoencoderKLWan decode (480x832x17) + breakdown -> wan_vae_{decode,breakdown}_h200.csv
#   flux     FLUX.1-dev-size step (ditfuse bench flux)                            -> flux_{step,breakdown}_h200.csv
#   wan      Wan2.1-1.3B-size step at 480x832x81 (ditfuse bench wan)              -> wan_{step,breakdown}_h200.csv
#   flux2    FLUX.2-dev-size step at 1024x1024 (ditfuse bench flux2)              -> flux2_{step,breakdown}_h200.csv
#   flux3    FLUX.3-size step at 1024x1024 (ditfuse bench flux3)                  -> flux3_{step,breakdown}_h200.csv
#   chroma   Chroma1-HD-size step at 1024x1024 (ditfuse bench chroma)             -> chroma_{step,breakdown}_h200.csv
#   sd3      SD3.5-large-size step at 1024x1024 (ditfuse bench sd3)               -> sd3_{step,breakdown}_h200.csv
#   qwenimage  Qwen-Image-size step at 1024x1024 (ditfuse bench qwenimage)        -> qwenimage_{step,breakdown}_h200.csv
#   zimage   Z-Image-6B-size step at 1024x1024 (ditfuse bench zimage)             -> zimage_{step,breakdown}_h200.csv
#   hunyuanvideo  HunyuanVideo-size step at 848x480x61 (ditfuse bench hunyuanvideo) -> hunyuanvideo_{step,breakdown}_h200.csv
#   hunyuanvideo15  HunyuanVideo-1.5-size step at 848x480x121 (ditfuse bench hunyuanvideo15) -> hunyuanvideo15_{step,breakdown}_h200.csv
#   qwenimage21  Qwen-Image-2.1-size KV-cached step at 1024x1024 (ditfuse bench qwenimage21) -> qwenimage21_{step,breakdown}_h200.csv
#   drift    28-step latent drift, FLUX.1-dev size                                -> drift.json
#   parallel (>= 2 GPUs; not in `all`) context parallelism: the 2-GPU bitwise tests
#            (tests/gpu/test_context_parallel_gpu.py) and FLUX.1-dev / Wan-1.3B step time on 1 GPU
#            and on NGPUS (default 2) GPUs, eager vs lossless, Ulysses and ring     -> parallel_h200.csv
# File names say h200 above; each run tags them with its card (CARD, from torch's device name:
# h200, h100, ...). Output goes to $OUT (or out/gpu): suite.log with everything printed plus the files above;
# when they are more than the device tool's 8 files, all but suite.log are packed into results.tar.gz (PACK).
# Per-phase time limits: *_TIMEOUT variables; extra arguments: *_ARGS variables.
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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import torch, triton
print("gpu", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
try:
    import diffusers; print("diffusers", diffusers.__version__)
except Exception as e:
    print("diffusers missing:", e)
PY
# The card's short name tags every result file (h200, h100, ...): the device tool may lend either.
CARD="${CARD:-$(python3 -c 'import torch; n = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""; print(next((t for t in ("h200", "h100", "b200", "a100") if t in n), "gpu"))' 2>/dev/null || echo gpu)}"
echo "card tag: $CARD" | tee -a "$LOG"
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
if want probes; then  # PROBES: the probe scripts to run (default: RMS order, attention backends, host cost)
  for p in ${PROBES:-bench/probes/probe_rms_order.py bench/probes/probe_attention.py bench/probes/probe_host_cost.py}; do
    run_phase "$p" "${PROBE_TIMEOUT:-120}" env PROBE_ROWS=4096 OUT=/tmp/probe_out python3 "$p" ${PROBE_ARGS:-}
  done
fi
if want tests; then
  # TESTS: test paths (default tests/gpu); PYTEST_K: a -k expression. Each failure goes to
  # failures.log as it happens (tests/conftest.py), so a run cut off by TESTS_TIMEOUT still names
  # its failures. -q unless PYTEST_ARGS asks for -v (pytest adds the two up: -q -v is neither).
  export DITFUSE_FAILURE_LOG="$OUT/failures.log"
  verbosity=-q; [[ " ${PYTEST_ARGS:-} " == *" -v"* ]] && verbosity=
  run_phase tests "${TESTS_TIMEOUT:-420}" python3 -m pytest $verbosity -p no:cacheprovider -m gpu -rf --durations=15 \
    ${PYTEST_K:+-k "$PYTEST_K"} ${TESTS:-tests/gpu} ${PYTEST_ARGS:-}
  summary+=("  tests: $(grep -E '(passed|failed)' "$LOG" | tail -n 1)")
  [ -s "$OUT/failures.log" ] && summary+=("  failures ($(grep -c '^=== FAILED' "$OUT/failures.log")): $OUT/failures.log")
fi
want admit && run_phase admit "${ADMIT_TIMEOUT:-180}" python3 bench/admit.py ${ADMIT_ARGS:-}
want kernels && run_phase kernels "${KERNELS_TIMEOUT:-300}" python3 bench/bench_kernels.py --out "$OUT/kernels_${CARD}.csv" ${DITFUSE_COMMIT:+--commit $DITFUSE_COMMIT} ${KERNELS_ARGS:-}
if want vae; then
  run_phase group_norm "${VAE_TIMEOUT:-200}" python3 bench/bench_group_norm.py --out "$OUT/group_norm_${CARD}.csv" ${DITFUSE_COMMIT:+--commit $DITFUSE_COMMIT} ${GN_ARGS:-}
fi
if want vae || want vaekl; then
  run_phase vae_decode "${VAE_TIMEOUT:-200}" python3 bench/bench_vae.py --out "$OUT/vae_decode_${CARD}.csv" \
    --breakdown "$OUT/vae_breakdown_${CARD}.csv" ${VAE_ARGS:-}
fi
if want vae || want vaeflux2; then
  run_phase flux2_vae_decode "${VAE_TIMEOUT:-200}" python3 bench/bench_vae.py --model flux2 --out "$OUT/flux2_vae_decode_${CARD}.csv" \
    --breakdown "$OUT/flux2_vae_breakdown_${CARD}.csv" ${VAEFLUX2_ARGS:-}
fi
if want vae || want vaeqwen; then
  run_phase qwenimage_vae_decode "${VAE_TIMEOUT:-200}" python3 bench/bench_vae.py --model qwenimage --out "$OUT/qwenimage_vae_decode_${CARD}.csv" \
    --breakdown "$OUT/qwenimage_vae_breakdown_${CARD}.csv" ${VAEQWEN_ARGS:-}
fi
if want vae || want wan22vae; then
  run_phase wan22_vae_decode "${VAE_TIMEOUT:-200}" python3 bench/bench_vae.py --model wan22 --out "$OUT/wan22_vae_decode_${CARD}.csv" \
    --breakdown "$OUT/wan22_vae_breakdown_${CARD}.csv" ${WAN22VAE_ARGS:-}
fi
if want vae || want wanvae; then
  run_phase wan_vae_decode "${VAE_TIMEOUT:-200}" python3 bench/bench_vae.py --model wan --out "$OUT/wan_vae_decode_${CARD}.csv" \
    --breakdown "$OUT/wan_vae_breakdown_${CARD}.csv" ${WANVAE_ARGS:-}
fi
want flux && run_phase flux "${FLUX_TIMEOUT:-300}" python3 bench/bench_step.py --family flux --out-dir "$OUT" --tag "$CARD" ${FLUX_ARGS:-}
want wan && run_phase wan "${WAN_TIMEOUT:-400}" python3 bench/bench_step.py --family wan --out-dir "$OUT" --tag "$CARD" ${WAN_ARGS:-}
want flux2 && run_phase flux2 "${FLUX2_TIMEOUT:-400}" python3 bench/bench_step.py --family flux2 --out-dir "$OUT" --tag "$CARD" ${FLUX2_ARGS:-}
want chroma && run_phase chroma "${CHROMA_TIMEOUT:-300}" python3 bench/bench_step.py --family chroma --out-dir "$OUT" --tag "$CARD" ${CHROMA_ARGS:-}
want flux3 && run_phase flux3 "${FLUX3_TIMEOUT:-300}" python3 bench/bench_step.py --family flux3 --out-dir "$OUT" --tag "$CARD" ${FLUX3_ARGS:-}
want sd3 && run_phase sd3 "${SD3_TIMEOUT:-300}" python3 bench/bench_step.py --family sd3 --out-dir "$OUT" --tag "$CARD" ${SD3_ARGS:-}
want qwenimage && run_phase qwenimage "${QWEN_TIMEOUT:-300}" python3 bench/bench_step.py --family qwenimage --out-dir "$OUT" --tag "$CARD" ${QWEN_ARGS:-}
want zimage && run_phase zimage "${ZIMAGE_TIMEOUT:-300}" python3 bench/bench_step.py --family zimage --out-dir "$OUT" --tag "$CARD" ${ZIMAGE_ARGS:-}
want hunyuanvideo && run_phase hunyuanvideo "${HY_TIMEOUT:-400}" python3 bench/bench_step.py --family hunyuanvideo --out-dir "$OUT" --tag "$CARD" ${HY_ARGS:-}
want hunyuanvideo15 && run_phase hunyuanvideo15 "${HY15_TIMEOUT:-400}" python3 bench/bench_step.py --family hunyuanvideo15 --out-dir "$OUT" --tag "$CARD" ${HY15_ARGS:-}
want qwenimage21 && run_phase qwenimage21 "${QWEN21_TIMEOUT:-300}" python3 bench/bench_step.py --family qwenimage21 --out-dir "$OUT" --tag "$CARD" ${QWEN21_ARGS:-}
want drift && run_phase drift "${DRIFT_TIMEOUT:-300}" python3 -m ditfuse.runtime.cli drift --model flux-dev --transformer-only --steps 28 --size 1024x1024 --out-dir /tmp/drift ${DRIFT_ARGS:-} && cp /tmp/drift/drift.json "$OUT/" 2>/dev/null
if [[ " ${phases[*]} " == *" parallel "* ]]; then  # explicit only: needs a multi-GPU machine
  n="${NGPUS:-2}"
  run_phase parallel_tests "${PARALLEL_TIMEOUT:-600}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
    tests/gpu/test_context_parallel_gpu.py ${PYTEST_ARGS:-}
  for fam in flux wan; do
    run_phase "parallel_${fam}_1gpu" "${PARALLEL_TIMEOUT:-600}" python3 bench/bench_parallel.py --family "$fam" \
      --out "$OUT/parallel_${CARD}.csv"
    for mode in ulysses ring; do
      run_phase "parallel_${fam}_${n}gpu_${mode}" "${PARALLEL_TIMEOUT:-600}" python3 -m torch.distributed.run --standalone \
        --nproc-per-node "$n" bench/bench_parallel.py --family "$fam" --mode "$mode" --out "$OUT/parallel_${CARD}.csv"
    done
  done
  python3 bench/bench_parallel.py --summarize "$OUT/parallel_${CARD}.csv" 2>&1 | tee -a "$LOG"
fi
echo "== summary ==" | tee -a "$LOG"
printf '%s\n' "${summary[@]}" | tee -a "$LOG"
# The device tool returns at most 8 files from $OUT (round 16 lost a suite.log and three result
# files that way): with more, every file but suite.log goes into results.tar.gz (PACK=1 always,
# PACK=0 never; default auto).
files=()
while IFS= read -r f; do files+=("$f"); done < <(cd "$OUT" && find . -maxdepth 1 -type f ! -name suite.log ! -name results.tar.gz -printf '%f\n' | sort)
if [ "${PACK:-auto}" = 1 ] || { [ "${PACK:-auto}" = auto ] && [ $(( ${#files[@]} + 1 )) -gt 8 ]; }; then
  if [ ${#files[@]} -gt 0 ] && (cd "$OUT" && tar czf results.tar.gz "${files[@]}"); then
    (cd "$OUT" && rm -f "${files[@]}")
    echo "packed ${#files[@]} result files into $OUT/results.tar.gz (tar xzf results.tar.gz)" | tee -a "$LOG"
  fi
fi
exit $status
