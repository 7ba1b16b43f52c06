#!/usr/bin/env bash
# Test job: the shared bring-up (slurm/ray_on_slurm.sh), then a driver that runs a real Ray task on every node,
# writes "ready" to $MARKER and keeps running until the test stops something.
#SBATCH --job-name=mppo-ray-tasks
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:05:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# shellcheck source=slurm/ray_on_slurm.sh
source slurm/ray_on_slurm.sh
mppo_ray_up
# (a background command's stdin is /dev/null: the driver comes as -c, not on stdin)
DRIVER=$(cat <<'PY'
import os, socket, time
import ray
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)

@ray.remote(num_cpus=1)
def where():
    return socket.gethostname()

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
hosts = ray.get([where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                 for n in nodes])
print("ray tasks ran on", sorted(hosts), flush=True)
with open(os.environ["MARKER"], "w") as f:
    f.write(f"ready {os.environ['RAY_ADDRESS']} {os.getpid()}\n")
time.sleep(float(os.environ.get("HOLD_S", "0")))
print("driver done", flush=True)
PY
)
mppo_run_driver python -c "${DRIVER}"
