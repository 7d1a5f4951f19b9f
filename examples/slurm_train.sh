#!/bin/bash
# torchforge train on several machines under SLURM: one launcher per node, each starting one
# process per GPU; node 0 hosts the rendezvous. Submit with `sbatch examples/slurm_train.sh`.
#
# The output_dir (in run.yaml) must be on a filesystem every node sees: every process writes
# its shards of each checkpoint there, and rank 0 the metrics and the final model. A job that
# is requeued (--requeue, or preempted) continues from its last checkpoint: --resume starts a
# new run when output_dir holds none yet.
#SBATCH --job-name=torchforge
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node; it starts the GPU processes
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --output=%x-%j.out

set -euo pipefail

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}

# SLURM_NODEID is this node's index in the job (0 .. nodes-1): the node rank.
srun --kill-on-bad-exit=1 bash -c "torchforge train --config run.yaml --resume \
    --nproc ${SLURM_GPUS_ON_NODE:-8} --nnodes $SLURM_NNODES --node-rank \$SLURM_NODEID \
    --master-addr $MASTER_ADDR --master-port $MASTER_PORT"
