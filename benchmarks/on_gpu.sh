#!/usr/bin/env bash
# What a lent GPU checks in one call (docs/benchmarks.md, "On a GPU"), each part under its own time limit:
#   1. the CUDA tests (pytest -m cuda: NCCL on one rank, streams, memory, checkpoints, --calibrate on the GPU);
#   2. the split backward's costs on the GPU, at the models' own sizes (launch-bound) and at width 2048 with 64
#      rows or sequences a micro-batch (the GPU busy);
#   3. a hardware description measured there, against the h200 preset;
#   4. the whole suite, as a user with a GPU would run it (the CUDA tests again among them).
#
#     bash benchmarks/on_gpu.sh OUTDIR
set -u
out=${1:-out/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$SECONDS
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, \
transformers.__version__, torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee "$out/machine.txt"

echo "== 1. CUDA tests ($((SECONDS - start)) s)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rsP -m cuda tests >"$out/cuda_tests.log" 2>&1
echo "exit $?"
grep -E "passed|failed|skipped|error|matmul efficiency|measured on" "$out/cuda_tests.log" | tail -12

echo "== 2. split backward ($((SECONDS - start)) s)"
for sizes in "" "--width 2048 --batch 64"; do
    # shellcheck disable=SC2086
    timeout 150 python3 benchmarks/split_backward.py --device cuda --rounds 21 $sizes 2>&1 |
        grep -v AttentionInterface | tee -a "$out/split_backward.txt"
done

echo "== 3. calibrate against the h200 preset ($((SECONDS - start)) s)"
timeout 120 python3 -m pipeengine.tune --calibrate --hardware h200 --out "$out/h200_measured.json" \
    >"$out/calibrate.log" 2>&1
echo "exit $?"
tail -5 "$out/calibrate.log"
python3 - "$out/h200_measured.json" <<'EOF'
import json, sys
from pipeengine.planner.cluster import load
found, preset = load(sys.argv[1]), load("h200")
for field in ("matmul_efficiency", "memory_bandwidth"):
    print(f"{field}: measured {getattr(found, field):.4g}, preset {getattr(preset, field):.4g}; {found.sources[field]}")
EOF

echo "== 4. the whole suite ($((SECONDS - start)) s)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 14 --timeout 150 >"$out/suite.log" 2>&1
echo "exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.log" | tail -25
echo "== done ($((SECONDS - start)) s)"
