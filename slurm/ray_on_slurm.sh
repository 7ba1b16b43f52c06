#!/usr/bin/env bash
# Ray-on-Slurm bring-up shared by slurm/ppo_*.sh (sourced, not run). Inside an sbatch allocation:
#   mppo_setup_env              PATH (the venv), the job's nodes, CPUs/GPUs per node, port, Ray temp dir
#   mppo_ray_up                 Ray head on the first node, a worker on every other, each `ray start --block` in
#                               its own `srun --overlap` step (Slurm tracks and kills it; a daemonised ray would
#                               escape job cleanup), a per-job Ray temp dir, explicit --num-cpus/--num-gpus from
#                               Slurm (Ray's own CPU/GPU detection sees the whole machine, not the allocation),
#                               the head IP detected on the head node; then waits until every node has joined
#                               (MPPO_RAY_JOIN_TIMEOUT s, else an error naming the missing nodes) and exports
#                               RAY_ADDRESS for `megatron-ppo train` (distributed/cluster.py connect_or_start).
#   mppo_run_driver CMD...      runs the driver and watches every Ray step: if the driver ends, its exit code is
#                               the job's; if a node's Ray process or srun step dies first, the job says which
#                               node and exits non-zero at once (the driver is stopped), and teardown requeues
#                               the job (MPPO_REQUEUE_ON_NODE_LOSS): its next run resumes on the nodes Slurm
#                               gives it, fewer for a `--nodes=MIN-MAX` job (DP shrinks). SIGUSR1 (preemption
#                               warning, `#SBATCH --signal=B:USR1@...`: B: so that only this shell gets it, never
#                               the Ray ranks, which die on signals) is forwarded to the driver, which finishes
#                               its step, checkpoints and exits 0; teardown then requeues the job
#                               (`scontrol requeue`, needs `#SBATCH --requeue`) and the next run of the same job
#                               id resumes from that checkpoint (trainer.resume_mode=auto, MPPO_RUN_DIR).
#   teardown                    trap EXIT: driver, srun steps and any process of this job's Ray temp dir are
#                               stopped on every node, nothing is left running; then the requeue, if preempted.
# MPPO_RUN_ARGS (set by mppo_setup_env): trainer.log_dir / trainer.default_local_dir in MPPO_RUN_DIR, a directory
# keyed by the job id, so the requeued run (same job id) finds the checkpoint and appends to the same metrics;
# put it before the user's overrides, which win.
# Settings (environment): MPPO_VENV (default: $SLURM_SUBMIT_DIR/.venv), MPPO_RUN_DIR (default:
# $MPPO_RUN_ROOT/<job name>-<job id>, MPPO_RUN_ROOT default outputs/slurm; set MPPO_RUN_DIR to continue an
# earlier job's run in a new job), MPPO_RAY_PORT (default: 6379 + job id mod 1000), MPPO_RAY_JOIN_TIMEOUT
# (default 300 s), MPPO_CKPT_GRACE (default 240 s: how long the driver may take to checkpoint after USR1),
# MPPO_NODE_LOSS_GRACE (default 20 s: how long the driver may take to name a lost node), MPPO_REQUEUE_ON_NODE_LOSS
# (default 1: a lost node requeues the job, as a preemption does; 0: the job just fails), MPPO_GPUS_PER_NODE,
# MPPO_CPUS_PER_NODE (defaults from Slurm).

set -euo pipefail

MPPO_LOG_PREFIX="[ray-on-slurm ${SLURM_JOB_ID:-?}]"
MPPO_RAY_STEPS=()                 # pids of the srun steps that hold `ray start --block`
declare -A MPPO_STEP_NODE=()      # pid -> node
MPPO_DRIVER_PID=""
MPPO_PREEMPTED=0                  # USR1 arrived
MPPO_REQUEUE=0                    # teardown requeues the job (after a preemption or a lost node)
MPPO_EXIT_NODE_LOST=75            # megatron-ppo train's exit code when a node was lost (distributed/group.py)

mppo_log() { echo "${MPPO_LOG_PREFIX} $(date +%T) $*" >&2; }
mppo_die() { mppo_log "ERROR: $*"; exit 1; }

mppo_setup_env() {
  [[ -n "${SLURM_JOB_ID:-}" ]] || mppo_die "not inside a Slurm job (no SLURM_JOB_ID): submit with sbatch"
  local venv="${MPPO_VENV:-${SLURM_SUBMIT_DIR:-$PWD}/.venv}"
  if [[ -x "${venv}/bin/ray" ]]; then
    export PATH="${venv}/bin:${PATH}"
  fi
  command -v ray >/dev/null || mppo_die "no 'ray' on PATH (set MPPO_VENV to the virtualenv holding megatron_ppo)"
  mapfile -t MPPO_NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST}")
  MPPO_HEAD="${MPPO_NODES[0]}"
  MPPO_CPUS="${MPPO_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}"
  MPPO_GPUS="${MPPO_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}"
  MPPO_RAY_PORT="${MPPO_RAY_PORT:-$((6379 + SLURM_JOB_ID % 1000))}"
  # Short and per job: Ray's unix sockets live under it (108-byte path limit) and a stale one hangs ray.init.
  MPPO_RAY_TMP="/tmp/ray-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"  # node i's: ${MPPO_RAY_TMP}-n<i>
  MPPO_RUN_DIR="${MPPO_RUN_DIR:-${MPPO_RUN_ROOT:-outputs/slurm}/${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID}}"
  # shellcheck disable=SC2034  # used by the job scripts that source this file
  MPPO_RUN_ARGS=("trainer.log_dir=${MPPO_RUN_DIR}/logs" "trainer.default_local_dir=${MPPO_RUN_DIR}/checkpoints")
  export RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0
  # Token authentication with a token of this job only (srun passes the environment to every node): without it,
  # Ray >= 2.5x enables tokens whenever ~/.ray/auth_token exists on one side, and the head and the clients
  # disagree ("InvalidAuthToken"); with it, no other job on a shared node can talk to this cluster.
  RAY_AUTH_TOKEN="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN
  mppo_log "run ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID} (restart count); run dir ${MPPO_RUN_DIR}"
  mppo_log "nodes: ${MPPO_NODES[*]} (head ${MPPO_HEAD}); per node ${MPPO_CPUS} CPUs, ${MPPO_GPUS} GPUs;" \
    "Ray temp dirs ${MPPO_RAY_TMP}-n<node index>"
}

# One srun step on one node, in the background; its pid is watched.
mppo_step() {
  local node="$1"; shift
  local gres=()
  if (( MPPO_GPUS > 0 )); then gres=(--gres="gpu:${MPPO_GPUS}"); fi
  srun --overlap --nodes=1 --ntasks=1 --nodelist="${node}" --cpus-per-task="${MPPO_CPUS}" "${gres[@]}" \
    --kill-on-bad-exit=1 --job-name="ray-${node}" "$@" &
  MPPO_RAY_STEPS+=("$!")
  MPPO_STEP_NODE[$!]="${node}"
}

# Node i's Ray temp dir: one per node, as if /tmp were node-local even where it is not (two raylets in one session
# dir race for their socket names); the index, not the hostname, keeps socket paths under the 108-byte limit.
mppo_node_tmp() { echo "${MPPO_RAY_TMP}-n$1"; }

mppo_head_ip() {
  # The address the other nodes reach the head at: the first address `hostname -I` lists on the head node.
  local ip
  ip="$(srun --overlap --nodes=1 --ntasks=1 --nodelist="${MPPO_HEAD}" hostname -I | awk '{print $1}')"
  [[ -n "${ip}" ]] || mppo_die "could not detect the IP address of head node ${MPPO_HEAD}"
  echo "${ip}"
}

mppo_ray_up() {
  [[ -n "${MPPO_HEAD:-}" ]] || mppo_setup_env
  trap teardown EXIT
  trap 'mppo_log "SIGTERM/SIGINT: stopping"; exit 143' TERM INT
  trap mppo_on_usr1 USR1
  MPPO_HEAD_IP="$(mppo_head_ip)"
  export RAY_ADDRESS="${MPPO_HEAD_IP}:${MPPO_RAY_PORT}"
  local common=(--block --num-cpus="${MPPO_CPUS}" --num-gpus="${MPPO_GPUS}" --disable-usage-stats)
  mppo_step "${MPPO_HEAD}" ray start --head --node-ip-address="${MPPO_HEAD_IP}" --port="${MPPO_RAY_PORT}" \
    --include-dashboard=false --temp-dir="$(mppo_node_tmp 0)" "${common[@]}"
  local i
  for (( i = 1; i < ${#MPPO_NODES[@]}; i++ )); do
    mppo_step "${MPPO_NODES[i]}" ray start --address="${RAY_ADDRESS}" --temp-dir="$(mppo_node_tmp "${i}")" \
      "${common[@]}"
  done
  mppo_wait_joined
}

mppo_wait_joined() {
  local timeout="${MPPO_RAY_JOIN_TIMEOUT:-300}" want="${#MPPO_NODES[@]}" out rc
  mppo_log "waiting up to ${timeout} s for ${want} Ray node(s) at ${RAY_ADDRESS}"
  set +e
  out="$(python - "${timeout}" "${MPPO_NODES[@]}" <<'PY'
import socket, sys, time
timeout, nodes = float(sys.argv[1]), sys.argv[2:]
deadline = time.monotonic() + timeout
import ray
while True:  # the head may not listen yet
    try:
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        break
    except Exception as exc:
        if time.monotonic() > deadline:
            print(f"missing: {' '.join(nodes)} (the Ray head did not answer: {exc})")
            sys.exit(1)
        time.sleep(1)
want = {n.split(".")[0] for n in nodes}
while True:
    alive = {n["NodeManagerHostname"].split(".")[0] for n in ray.nodes() if n["Alive"]}
    missing = sorted(want - alive)
    if not missing and len([n for n in ray.nodes() if n["Alive"]]) >= len(want):
        print(f"joined: {' '.join(sorted(alive))}")
        sys.exit(0)
    if time.monotonic() > deadline:
        print(f"missing: {' '.join(missing) or '(a second raylet per node expected)'}")
        sys.exit(1)
    time.sleep(1)
PY
)"
  rc=$?
  set -e
  if (( rc != 0 )); then
    mppo_die "Ray cluster incomplete after ${timeout} s: ${out}"
  fi
  mppo_log "Ray cluster up: ${out}"
}

mppo_on_usr1() {
  MPPO_PREEMPTED=1
  if [[ -n "${MPPO_DRIVER_PID}" ]]; then
    mppo_log "SIGUSR1 (preemption warning): asking the driver (pid ${MPPO_DRIVER_PID}) to checkpoint and exit"
    kill -USR1 "${MPPO_DRIVER_PID}" 2>/dev/null || true
  else
    mppo_log "SIGUSR1 before the driver started: the job is requeued without running it"
  fi
}

# Run the driver; return its exit code, or fail naming the node whose Ray step died first.
mppo_run_driver() {
  if (( MPPO_PREEMPTED )); then MPPO_REQUEUE=1; return 0; fi
  "$@" &
  MPPO_DRIVER_PID=$!
  local cmd="$*"
  cmd="${cmd//$'\n'/ }"
  mppo_log "driver pid ${MPPO_DRIVER_PID}: ${cmd:0:200}"
  local done_pid rc
  while true; do
    set +e
    wait -n -p done_pid "${MPPO_DRIVER_PID}" "${MPPO_RAY_STEPS[@]}"
    rc=$?
    set -e
    if [[ -z "${done_pid:-}" ]]; then
      # a trapped signal (USR1) interrupted the wait (-p leaves done_pid unset): after a preemption, give the
      # driver its grace period; otherwise keep watching
      if (( MPPO_PREEMPTED )); then mppo_wait_preempted; return $?; fi
      continue
    fi
    if [[ "${done_pid}" == "${MPPO_DRIVER_PID}" ]]; then
      MPPO_DRIVER_PID=""
      if (( MPPO_PREEMPTED )); then MPPO_REQUEUE=1; fi
      mppo_log "driver exited with ${rc}"
      if (( rc == MPPO_EXIT_NODE_LOST )); then mppo_requeue_after_node_loss "the driver named a lost node"; fi
      return "${rc}"
    fi
    mppo_node_lost "${MPPO_STEP_NODE[${done_pid}]}" "${done_pid}" "${rc}"
  done
}

# A node's Ray step ended while the driver runs: the driver's workers on it are gone too, and the driver names the
# node with the ranks it held within seconds (distributed/ray_group.py); give it MPPO_NODE_LOSS_GRACE s (default
# 20) to say so and exit, then stop the job either way.
mppo_node_lost() {
  local node="$1" pid="$2" rc="$3" waited=0 grace="${MPPO_NODE_LOSS_GRACE:-20}"
  mppo_log "node ${node}: its Ray process (srun step pid ${pid}) exited with code ${rc} while the driver was" \
    "running; waiting up to ${grace} s for the driver to report and exit"
  while kill -0 "${MPPO_DRIVER_PID}" 2>/dev/null && (( waited < grace )); do sleep 1; waited=$((waited + 1)); done
  if ! kill -0 "${MPPO_DRIVER_PID}" 2>/dev/null; then
    set +e
    wait "${MPPO_DRIVER_PID}"
    rc=$?
    set -e
    MPPO_DRIVER_PID=""
    mppo_log "driver exited with ${rc} after node ${node} was lost"
  fi
  mppo_requeue_after_node_loss "node ${node}'s Ray process exited"
  mppo_die "node ${node} lost (its Ray process exited); stopping the job"
}

# A lost node is not the run's fault: teardown requeues the job (it needs --requeue; MPPO_REQUEUE_ON_NODE_LOSS=0
# turns this off). Slurm starts it again once the lost node is DOWN, on the nodes it gives it (the drivers take
# cluster.nnodes from the allocation), and trainer.resume_mode=auto resumes from the last checkpoint, resharding
# to the new DP size.
mppo_requeue_after_node_loss() {
  if [[ "${MPPO_REQUEUE_ON_NODE_LOSS:-1}" == 1 ]]; then
    mppo_log "$1: the job is requeued after teardown (MPPO_REQUEUE_ON_NODE_LOSS=0: it just fails)"
    MPPO_REQUEUE=1
  fi
}

# After USR1: give the driver MPPO_CKPT_GRACE s to save and exit (teardown stops it after that); either way the
# job is requeued. Returns the driver's exit code (0: it saved).
mppo_wait_preempted() {
  local grace="${MPPO_CKPT_GRACE:-240}" waited=0 rc
  MPPO_REQUEUE=1
  while kill -0 "${MPPO_DRIVER_PID}" 2>/dev/null && (( waited < grace )); do sleep 1; waited=$((waited + 1)); done
  if kill -0 "${MPPO_DRIVER_PID}" 2>/dev/null; then
    mppo_log "driver still running ${grace} s after SIGUSR1: stopping it (the next run resumes from the" \
      "previous checkpoint, if any)"
    return 1
  fi
  set +e
  wait "${MPPO_DRIVER_PID}"
  rc=$?
  set -e
  MPPO_DRIVER_PID=""
  mppo_log "driver exited with ${rc} after SIGUSR1"
  return "${rc}"
}

mppo_requeue() {
  mppo_log "requeueing job ${SLURM_JOB_ID}: the next run resumes from the last checkpoint in ${MPPO_RUN_DIR}" \
    "(resume_mode=auto)"
  scontrol requeue "${SLURM_JOB_ID}" || mppo_log "scontrol requeue failed (was the job submitted with --requeue?)"
}

# Stop the driver and the Ray steps, then anything of this job's Ray temp dir that is still alive on each node.
teardown() {
  local rc=$?
  trap - EXIT TERM INT USR1
  set +e
  if [[ -n "${MPPO_DRIVER_PID}" ]] && kill -0 "${MPPO_DRIVER_PID}" 2>/dev/null; then
    kill -TERM "${MPPO_DRIVER_PID}"
    sleep 2
    kill -KILL "${MPPO_DRIVER_PID}" 2>/dev/null
  fi
  local pid
  for pid in "${MPPO_RAY_STEPS[@]}"; do kill -TERM "${pid}" 2>/dev/null; done
  # one deadline for all steps (a dead node's srun may never end on SIGTERM): at most 10 s, then SIGKILL
  local waited=0 alive
  while (( waited < 10 )); do
    alive=0
    for pid in "${MPPO_RAY_STEPS[@]}"; do kill -0 "${pid}" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 1; waited=$((waited + 1))
  done
  for pid in "${MPPO_RAY_STEPS[@]}"; do kill -KILL "${pid}" 2>/dev/null; done
  if [[ -n "${MPPO_RAY_TMP:-}" ]]; then
    local i
    for (( i = 0; i < ${#MPPO_NODES[@]}; i++ )); do
      # Ray's processes name their session dir (<temp dir>/session_...) on their command line; this step's own
      # command line holds only the temp dir, so it never matches itself. In parallel, bounded: a dead node's
      # srun waits for Slurm to give up on it, and the job must still end promptly.
      # shellcheck disable=SC2016  # expanded on the node
      timeout 15 srun --overlap --nodes=1 --ntasks=1 --nodelist="${MPPO_NODES[i]}" bash -c \
        'pids=$(pgrep -f -- "$1/session"); [ -n "$pids" ] && kill -KILL $pids; rm -rf "$1"; true' \
        _ "$(mppo_node_tmp "${i}")" >/dev/null 2>&1 &
    done
    wait
  fi
  mppo_log "teardown done (exit ${rc})"
  # Last: Slurm ends a running job it requeues (SIGTERM, then SIGKILL), so nothing may be left to do here.
  if (( MPPO_REQUEUE )); then mppo_requeue; fi
  exit "${rc}"
}
