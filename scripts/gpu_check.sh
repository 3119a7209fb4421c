#!/usr/bin/env bash
# Everything GPU-side: the tests marked gpu, then the benchmarks (kernels and the engine at 8B /
# V2-Lite sizes, and where a decode step's kernel time goes), results and logs under OUT_DIR.
#   bash scripts/gpu_check.sh OUT_DIR [--skip-attention] [--part tests-a|tests-b|tests-c|benchmarks]
# The whole no longer fits one 10-minute device call: --part runs one share of it (the GPU test
# files by name: a-f, g-l, m-z; or the benchmarks), each within a call. On a fresh machine the
# grammar tests need llguidance: carry it as a wheel in .whl (pip download --platform
# manylinux_2_31_x86_64 llguidance==1.9.1), which this script installs first.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: gpu_check.sh OUT_DIR [--skip-attention] [--part tests-a|tests-b|tests-c|benchmarks]"
out=${1:?$usage}
shift
skip_attention=0
part=all
while [ $# -gt 0 ]; do
    case $1 in
        --skip-attention) skip_attention=1 ;;
        --part) part=${2:?$usage}; shift ;;
        *) echo "gpu_check.sh: unknown option '$1'; $usage" >&2; exit 2 ;;
    esac
    shift
done
case $part in
    all) tests=(tests/gpu) ;;
    tests-a) tests=(tests/gpu/test_[a-f]*.py) ;;
    tests-b) tests=(tests/gpu/test_[g-l]*.py) ;;
    tests-c) tests=(tests/gpu/test_[m-z]*.py) ;;
    benchmarks) tests=() ;;
    *) echo "gpu_check.sh: unknown part '$part'; $usage" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Wheels carried to a bare machine (llguidance for the grammar tests): `.whl/*.whl`, installed aside.
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
stage() { echo "[gpu_check] $1 done at ${SECONDS}s" | tee -a "$out/stages.log"; }  # the issue's budget: 10 minutes
if [ ${#tests[@]} -gt 0 ]; then
    python3 -m pytest -m gpu "${tests[@]}" -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$out/gpu_tests.log" | tail -25
    stage gpu_tests
fi
case $part in all|benchmarks) ;; *) exit 0 ;; esac
kernels=attention_decode,attention_verify,attention_prefill,mla_decode,mla_verify,moe,moe_int4,gemm_small_m,gemm_fp8,rms_norm,rope,silu_and_mul
[ $skip_attention = 1 ] && kernels=${kernels#attention_decode,attention_verify,attention_prefill,}
python3 -m foretell.cli bench kernels --preset quick --kernels "$kernels" --output-json "$out/bench_kernels.json" \
    2>&1 | tee "$out/bench_kernels.log" | tail -80
stage bench_kernels
python3 scripts/bench_gpu.py "$out" 2>&1 | tee "$out/bench_gpu.log" | grep -v "^max_model_len"
stage bench_gpu
python3 scripts/profile_decode.py "$out" 2>&1 | tail -30
stage profile_decode
python3 scripts/profile_host.py "$out" 2>&1 | head -12
stage profile_host
