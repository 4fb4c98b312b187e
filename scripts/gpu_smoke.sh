#!/usr/bin/env bash
# The first thing to run on a new GPU machine (1 to 8 GPUs, PyTorch >= 2.6): about 8 minutes on one H100/H200-class
# GPU, no download (synthetic data), the kernel level first, each stage within its own time budget, stopping at
# SMOKE_BUDGET_S seconds (default 480) with everything so far written. It answers in numbers, in $OUT/summary.json
# (with $OUT/smoke.log, every command's output, $OUT/kernels.json, the kernels' whole account, and $OUT/table.md,
# the card's table for docs/speed.md): every hot kernel at the card's shape against the reference, alone with its
# bytes, and the host's cost per call and per launch (scripts/kernel_bench.py); then Pre-LN and Full AttnRes at
# L70 d640 micro-batch 2 with the kernel profile, then the other designs, then correctness on CUDA, the plan's
# micro-batch, whole-model compile and CUDA graphs, the 400M checks. What each number means: scripts/gpu_smoke.py,
# whose options this passes on (its tiny flag rehearses it on a CPU).
#
# liger-kernel beside ours (optional): a wheel in .whl/ (ignored by git; the device tool carries it with
# carry=[".whl"]), fetched beforehand with pip's download command (liger-kernel==0.8.5, no dependencies, into .whl),
# is installed by the environment check of a GPU run without its dependencies (scripts/gpu_smoke.py, liger_wheel).
#
#   bash scripts/gpu_smoke.sh                  # OUT=/tmp/depthbench-smoke SMOKE_BUDGET_S=480 by default
set -u
cd "$(dirname "$0")/.."
# installs nothing when the imports work (a GPU machine often has its own PyTorch and no network)
if ! python -c "import torch, numpy, tiktoken" 2> /dev/null; then
    python -m pip install -q -r requirements.txt || exit 1
fi
exec python scripts/gpu_smoke.py "$@"
