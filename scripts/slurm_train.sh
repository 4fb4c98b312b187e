#!/usr/bin/env bash
# One train.py run over several SLURM nodes: one torchrun per node (srun starts it), one process per GPU, the
# nodes meeting by c10d rendezvous at the first node. Submit from the repository root, on a filesystem every
# node sees (the run folder and the token shards live there: docs/training.md#multi-node):
#
#   sbatch --nodes 2 scripts/slurm_train.sh --suite 400m --layers 70 --residual mhc --out /shared/runs
#   sbatch --nodes 2 scripts/slurm_train.sh --suite 400m --layers 70 --residual mhc --out /shared/runs --resume
#
# GPUS_PER_NODE (default 8) and PORT (default 29500) can be set in the environment. At the time limit SLURM sends
# SIGTERM two minutes early (--signal); torchrun passes it on and every rank stops at its next micro-batch, the step
# in progress dropped and the last completed step's ckpt.pt kept (docs/training.md#stopping): resubmit with --resume.
#SBATCH --job-name=depthbench
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=04:00:00
#SBATCH --signal=TERM@120
#SBATCH --output=%x-%j.out
set -eu
cd "${SLURM_SUBMIT_DIR:-.}"
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --kill-on-bad-exit=1 python -m torch.distributed.run --nnodes "$SLURM_NNODES" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:${PORT:-29500}" \
    --rdzv-id "$SLURM_JOB_ID" train.py "$@"
