#!/usr/bin/env bash
# The first thing to run on a new GPU machine (1 to 8 GPUs, PyTorch >= 2.6): about 8 minutes on one H100/H200-class
# GPU, most informative check first, stopping at SMOKE_BUDGET_S seconds (default 480) with everything so far
# written. It answers in numbers, in $OUT/summary.json (with $OUT/smoke.log, every command's output): Pre-LN 400M
# tokens/s and MFU, each design's step time over Pre-LN's with each kernels value, compile seconds at L24 and L70,
# planned vs measured memory, bf16 vs fp32 losses and (2+ GPUs) DDP vs FSDP2 losses. What each number means and
# how it is measured: scripts/gpu_smoke.py, whose options this passes on (its tiny flag rehearses it on a CPU).
#
#   bash scripts/gpu_smoke.sh                  # OUT=/tmp/depthbench-smoke SMOKE_BUDGET_S=480 by default
set -u
cd "$(dirname "$0")/.."
# installs nothing when the imports work (a GPU machine often has its own PyTorch and no network)
if ! python -c "import torch, numpy, tiktoken" 2> /dev/null; then
    python -m pip install -q -r requirements.txt || exit 1
fi
exec python scripts/gpu_smoke.py "$@"
