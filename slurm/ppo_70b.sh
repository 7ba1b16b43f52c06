#!/usr/bin/env bash
# PPO on a Llama-3-70B-shaped actor and critic (configs/ppo_70b.yaml: TP8 PP4 DP4 on 16 nodes x 8 GPUs; check a
# change with `megatron-ppo plan --config configs/ppo_70b.yaml` first):
#   sbatch slurm/ppo_70b.sh [key=value ...]          (from the repository root)
#   MODEL_PATH=/path/to/Meta-Llama-3-70B-Instruct sbatch slurm/ppo_70b.sh     (real weights instead of the shape)
# Ray head on the first node, a worker per other node; the driver runs in this batch step. A dead node's Ray
# process ends the job within seconds naming the node. Preemption: Slurm sends USR1 10 minutes before the end,
# the driver checkpoints and exits, the job requeues itself and resumes (trainer.resume_mode=auto) from its run
# dir, MPPO_RUN_DIR (default outputs/slurm/mppo-70b-<job id>: the requeued run has the same job id; set it to an
# earlier job's dir to continue that run in a new job).
#SBATCH --job-name=mppo-70b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# shellcheck source=slurm/ray_on_slurm.sh
source "${MPPO_SLURM_DIR:-slurm}/ray_on_slurm.sh"

mppo_setup_env
CONFIG="${CONFIG:-configs/ppo_70b.yaml}"
model=()
if [[ -n "${MODEL_PATH:-}" ]]; then
  model=("actor.model.path=${MODEL_PATH}" actor.model.arch=null actor.model.tokenizer_path=null)
fi
# The layout must fit before 128 GPUs start: the planner exits 1 (and says why) when it does not.
megatron-ppo plan --config "${CONFIG}" --gpus "$((SLURM_JOB_NUM_NODES * ${SLURM_GPUS_ON_NODE:-8}))" \
  "cluster.nnodes=${SLURM_JOB_NUM_NODES}" "${model[@]}" "$@" | tail -n 12 \
  || mppo_die "megatron-ppo plan: ${CONFIG} does not fit this allocation"

mppo_ray_up
mppo_run_driver megatron-ppo train --config "${CONFIG}" trainer.resume_mode=auto \
  "cluster.nnodes=${SLURM_JOB_NUM_NODES}" "${MPPO_RUN_ARGS[@]}" "${model[@]}" "$@"
