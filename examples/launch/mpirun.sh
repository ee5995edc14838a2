#!/bin/bash
# Open MPI 4 (JAX 0.10.2 detects Open MPI <= 4): 2 nodes of 8 GPUs, one process per GPU; rank 0's
# host is the coordinator. --bind-to none: each process's input workers use every core.
mpirun -np 16 -H node0:8,node1:8 --bind-to none -x PATH -x LD_LIBRARY_PATH \
    resnet --coordinator_address=auto --data_dir=/shared/imagenet \
    --model_dir=/shared/runs/resnet50 --train_batch_size=2048
