#!/usr/bin/env bash
# The first thing to run on a new GPU machine (1 to 8 GPUs, PyTorch >= 2.6): about 6 minutes on one H100/H200-class
# GPU, no download (synthetic data), most informative check first, stopping at SMOKE_BUDGET_S seconds (default 360)
# with everything so far written. It answers in numbers, in $OUT/summary.json (with $OUT/smoke.log, every command's
# output, and $OUT/table.md, the card's table for docs/speed.md): every design on CUDA against the CPU reference;
# the L70 d640 table at micro-batch 2 and at the planned one (step ms, x Pre-LN, busy share, kernels, peak memory,
# the roofline's estimate beside each); whole-model compile and CUDA graphs against per-block compile; then Pre-LN
# 400M tokens/s and MFU, bf16 vs fp32, DDP vs FSDP2 (2+ GPUs), memory, compile seconds, each design at L16. What
# each number means: scripts/gpu_smoke.py, whose options this passes on (its tiny flag rehearses it on a CPU).
#
#   bash scripts/gpu_smoke.sh                  # OUT=/tmp/depthbench-smoke SMOKE_BUDGET_S=360 by default
set -u
cd "$(dirname "$0")/.."
# installs nothing when the imports work (a GPU machine often has its own PyTorch and no network)
if ! python -c "import torch, numpy, tiktoken" 2> /dev/null; then
    python -m pip install -q -r requirements.txt || exit 1
fi
exec python scripts/gpu_smoke.py "$@"
