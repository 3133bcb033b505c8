#!/usr/bin/env bash
# On a machine with a CUDA GPU: the tests that run the VRAM tier and the device compute path (they run
# on the CPU stand-in everywhere, and on the GPU too where torch sees one), then tools/bench_device.py
# on a Mixtral-shaped random model (tools/make_synthetic_model.py, converted to INT4). pytest's addopts
# are replaced: their -q would cancel the -v that lists each test with its device.
#     tools/check_gpu.sh [WORK_DIR] [MAKE_SYNTHETIC_MODEL_ARGS...]
set -uo pipefail
work=${1:-/tmp/edgemoe-gpu}; shift || true
mkdir -p "$work"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, numba, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'numba', numba.__version__, 'numpy', numpy.__version__)"
lscpu | grep -E "Model name|^CPU\(s\)"
python3 -m pytest -o addopts=--import-mode=importlib -v -p no:cacheprovider -p no:warnings tests/test_store.py tests/test_latency.py \
    tests/test_gpt_oss.py tests/test_switch.py -k "vram or device or compute or round_trip" > "$work/tests.log" 2>&1
echo "tests on the GPU: $(grep -c 'cuda.*PASSED' "$work/tests.log") passed, $(grep -c 'cuda.*FAILED' "$work/tests.log") failed; $(tail -1 "$work/tests.log")"
python3 tools/make_synthetic_model.py --out "$work/model" "$@" | tail -1
python3 -m edgemoe convert "$work/model" --out "$work/int4" --bits 4 -q --force | tail -1
for threads in 2 16; do
    python3 tools/bench_device.py "$work/int4" --threads $threads --json "$work/bench-$threads.json" \
        $([ $threads = 2 ] && echo --breakdown)
done
