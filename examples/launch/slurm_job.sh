#!/bin/bash
# sbatch slurm_job.sh: 2 nodes of 8 GPUs. One task per GPU: JAX's SLURM detection
# (--coordinator_address=auto) gives each process the GPU of its local rank; the first node
# is process 0's host and the coordinator.
#SBATCH --job-name=resnet50
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
srun resnet --coordinator_address=auto --data_dir=/shared/imagenet \
    --model_dir=/shared/runs/resnet50 --train_batch_size=2048
