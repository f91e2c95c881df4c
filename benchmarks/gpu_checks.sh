#!/usr/bin/env bash
# The GPU checks of one lent GPU machine, in one call (pure PyTorch: no torchrec, fbgemm-gpu or Ray needed).
#   bash benchmarks/gpu_checks.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./gpu-checks
# Writes one log per part into OUT_DIR and prints them; each part has its own time limit, so one hang costs only
# that part. What it runs: the `gpu`-marked tests, then benchmarks/bench_losses.py at the issue-14 sizes
# (n 849,000, d 128, B 8,192 in fp32 / tf32 / bf16), each table side by side with the fused Triton steps of
# issue 42 ("softmax fused", "rankmax k=1 fused": train.kernel=fused) and the GEMM floor, with each step's peak
# memory; then B 32,768 and 65,536 (fused and chunked; a chunked step that does not fit prints "out of memory").
# Triton comes with torch's CUDA wheel; the fused steps are left out where it is missing.
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
"$py" -c 'import triton; print("triton", triton.__version__)' 2>&1
# The issue-42 table: the floor, the chunked and the fused steps of softmax and Rankmax k = 1.
steps=(--only "GEMM floor (3 GEMMs)" --only softmax --only "softmax fused" --only "rankmax k=1" --only "rankmax k=1 fused")
part pytest-gpu 180 "$py" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider
part fused-fp32 100 "$py" -m benchmarks.bench_losses --device cuda --precision fp32 --warmup 2 "${steps[@]}"
part fused-tf32 70 "$py" -m benchmarks.bench_losses --device cuda --precision tf32 --warmup 2 "${steps[@]}"
part fused-bf16 70 "$py" -m benchmarks.bench_losses --device cuda --precision bf16 --warmup 2 "${steps[@]}"
part fused-b32k 120 "$py" -m benchmarks.bench_losses --device cuda --precision bf16 --batch 32768 --warmup 1 --rounds 3 "${steps[@]}"
part fused-b64k 150 "$py" -m benchmarks.bench_losses --device cuda --precision bf16 --batch 65536 --warmup 1 --rounds 3 "${steps[@]}"
# The chunked losses' full table (k = 10, sparsemax), as before issue 42.
part losses-tf32 70 "$py" -m benchmarks.bench_losses --device cuda --precision tf32 --warmup 2
