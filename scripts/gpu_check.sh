#!/usr/bin/env bash
# Everything GPU-side in one go: the tests marked gpu, then the benchmarks (kernels and the
# engine at 8B / V2-Lite sizes, and where a decode step's kernel time goes), results and logs under OUT_DIR.
#   bash scripts/gpu_check.sh OUT_DIR [--skip-attention]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_check.sh OUT_DIR [--skip-attention]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stage() { echo "[gpu_check] $1 done at ${SECONDS}s" | tee -a "$out/stages.log"; }  # the issue's budget: 10 minutes
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$out/gpu_tests.log" | tail -25
stage gpu_tests
kernels=attention_decode,attention_verify,attention_prefill,mla_decode,mla_verify,moe,moe_int4,gemm_small_m,gemm_fp8,rms_norm,rope,silu_and_mul
[ "${2:-}" = "--skip-attention" ] && kernels=${kernels#attention_decode,attention_verify,attention_prefill,}
python3 -m foretell.cli bench kernels --preset quick --kernels "$kernels" --output-json "$out/bench_kernels.json" \
    2>&1 | tee "$out/bench_kernels.log" | tail -80
stage bench_kernels
python3 scripts/bench_gpu.py "$out" 2>&1 | tee "$out/bench_gpu.log" | grep -v "^max_model_len"
stage bench_gpu
python3 scripts/profile_decode.py "$out" 2>&1 | tail -30
stage profile_decode
python3 scripts/profile_host.py "$out" 2>&1 | head -12
stage profile_host
