#!/usr/bin/env bash
# The GPU checks of one lent GPU machine, in one call (pure PyTorch: no torchrec, fbgemm-gpu or Ray needed).
#   bash benchmarks/gpu_checks.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./gpu-checks
# Writes one log per part into OUT_DIR and prints them; each part has its own time limit, so one hang costs only
# that part. What it runs: the `gpu`-marked tests, then benchmarks/bench_losses.py at the issue-14 sizes
# (n 849,000, d 128, B 8,192 in fp32 / tf32 / bf16, and B 32,768 chunked).
set -u
out="${1:-${OUT:-gpu-checks}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
part() {  # part NAME SECONDS COMMAND...
    local name="$1" limit="$2"
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.log"
    echo "=== $name: exit $rc in $((SECONDS - start)) s"
}
{ nvidia-smi -L; "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'; } 2>&1
part losses-fp32 100 "$py" -m benchmarks.bench_losses --device cuda --precision fp32 --warmup 2
part losses-tf32 70 "$py" -m benchmarks.bench_losses --device cuda --precision tf32 --warmup 2
part losses-bf16 70 "$py" -m benchmarks.bench_losses --device cuda --precision bf16 --warmup 2
part losses-b32k 90 "$py" -m benchmarks.bench_losses --device cuda --precision tf32 --batch 32768 --chunk auto --warmup 2
part pytest-gpu 180 "$py" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider
