#!/usr/bin/env bash
# The tiny CPU run (configs/tiny_cpu.yaml: 2 CPU ranks) as a Slurm job, through the same bring-up as ppo_70b.sh:
#   sbatch slurm/ppo_tiny.sh [key=value ...]          (from the repository root; overrides go to megatron-ppo train)
# CONFIG (default configs/tiny_cpu.yaml) and MPPO_VENV may be set in the environment. tests/slurm/ submits it.
# Logs and checkpoints go to MPPO_RUN_DIR (default outputs/slurm/mppo-tiny-<job id>). Preemption: USR1 60 s before
# the time limit (or `scancel --signal=USR1 --batch <job id>`) -> the driver saves and exits 0 -> the job requeues
# itself -> the next run of the job resumes from that step (tests/slurm/test_slurm_preemption.py). A lost node
# requeues it too; `sbatch --nodes=2-3` lets the next run continue on the nodes left, its DP resharded from the
# last checkpoint (cluster.nnodes follows the allocation; tests/slurm/test_slurm_multinode.py).
#SBATCH --job-name=mppo-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:15:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# shellcheck source=slurm/ray_on_slurm.sh
source "${MPPO_SLURM_DIR:-slurm}/ray_on_slurm.sh"

mppo_ray_up
mppo_run_driver megatron-ppo train --config "${CONFIG:-configs/tiny_cpu.yaml}" trainer.resume_mode=auto \
  cluster.device=cpu "cluster.nnodes=${SLURM_JOB_NUM_NODES:-1}" "${MPPO_RUN_ARGS[@]}" "$@"
