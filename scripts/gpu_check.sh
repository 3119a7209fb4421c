#!/usr/bin/env bash
# Everything GPU-side in one go: the tests marked gpu, then the benchmarks (kernels and the
# engine at 8B / V2-Lite sizes, and where a decode step's kernel time goes), results and logs under OUT_DIR.
#   bash scripts/gpu_check.sh OUT_DIR [--skip-attention]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_check.sh OUT_DIR [--skip-attention]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$out/gpu_tests.log" | tail -25
[ "${2:-}" = "--skip-attention" ] || python3 scripts/bench_attention.py "$out" --quick 2>&1 | tail -30
python3 scripts/bench_fused.py "$out" --quick 2>&1 | tail -20
python3 scripts/bench_mla_moe.py "$out" --quick 2>&1 | tail -30
python3 scripts/bench_small_m_gemm.py "$out" --quick 2>&1 | tail -16
python3 scripts/bench_gpu.py "$out" 2>&1 | tee "$out/bench_gpu.log" | grep -v "^max_model_len"
python3 scripts/profile_decode.py "$out" 2>&1 | tail -30
python3 scripts/profile_host.py "$out" 2>&1 | head -12
