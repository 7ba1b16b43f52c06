"""Several nodes (issue 27): `sbatch --nodes=3 slurm/ppo_tiny.sh` on three network-namespace nodes
(megatron_ppo/testing/netns_cluster.py: an address, hostname and slurmd each; slurmctld on node0). Ray's head runs on
node0 and a worker joins from each other node; every role is TP2 x DP3, so each TP group must sit inside one node
and the DP replicas span the three; gloo rendezvous with MASTER_ADDR on another host. Its metrics equal the same
layout run on one node. A node killed mid-run ends the run within 60 s with a line naming the node and the ranks it
held, nothing of it is left on the other nodes, and the job requeues itself and, given 2 nodes, resumes from its
last checkpoint on the two left, at DP2. A node that never joins is named within the join timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import FINAL_STATES, phase_recorder, processes_naming

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# actor and critic TP2 x DP3 on 3 nodes of 2 slots (TP2 x DP2 on 2); 12 prompts in one mini-batch: 4 per DP replica
# at DP3, 6 at DP2, micro-batches of 2; no KL loss, so no reference role: 12 ranks, not 18 (each rank's start-up
# costs ~5 s of the 2 cores)
LAYOUT = ("cluster.critic.tensor_model_parallel_size=2", "data.train_batch_size=12", "actor.use_kl_loss=false",
          "actor.ppo_mini_batch_size=12", "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=12",
          "critic.ppo_micro_batch_size_per_gpu=2", "ref.log_prob_micro_batch_size_per_gpu=2",
          "rollout.log_prob_micro_batch_size_per_gpu=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
          "trainer.seed=7")
COMPARED = ("reward/score/mean", "response_length/mean", "actor/entropy", "actor/pg_loss", "actor/ppo_kl",
            "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/returns/mean")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _submit(cluster, tmp_path: Path, steps: int, *extra: str) -> tuple[str, Path, Path]:
    """slurm/ppo_tiny.sh on the 3 nodes (cluster.nnodes follows the allocation), 2 slots each."""
    root, out = tmp_path / "runs", tmp_path / "job.out"
    r = cluster.run("sbatch", "--parsable", "--nodes=3", f"--output={out}",
                    f"--export=ALL,MPPO_RUN_ROOT={root}", "slurm/ppo_tiny.sh", "cluster.n_gpus_per_node=2",
                    f"trainer.total_training_steps={steps}", *LAYOUT, *extra, cwd=REPO)
    job_id = r.stdout.strip().split(";")[0]
    return job_id, root / f"mppo-tiny-{job_id}", out


def _check_placement(table: list[dict], cluster) -> None:
    """Where the ranks ran: each node holds one TP group (ranks 2d, 2d+1 = DP replica d) of every role; colocated:
    rank r of every role on the same node."""
    assert len(table) == 12 and {r["node"] for r in table} == {"node0", "node1", "node2"}, table
    addr = {n.name: n.addr for n in cluster.nodes}
    for role in ("actor", "critic"):
        rows = sorted((r for r in table if r["role"] == role), key=lambda r: r["rank"])
        assert [(r["tp"], r["dp"]) for r in rows] == [(t, d) for d in range(3) for t in range(2)], rows
        for d in range(3):
            tp_group = [r for r in rows if r["dp"] == d]
            assert len({r["node"] for r in tp_group}) == 1, f"{role} TP group of DP replica {d} spans nodes: {rows}"
            assert all(r["ip"] == addr[r["node"]] for r in tp_group), (tp_group, addr)
        assert len({r["node"] for r in rows}) == 3, f"{role}'s DP replicas are not on three nodes: {rows}"
    by_rank = {}
    for r in table:
        by_rank.setdefault(r["rank"], set()).add(r["node"])
    assert all(len(nodes) == 1 for nodes in by_rank.values()), by_rank


def _equal_one_node(tmp_path: Path, multi: list[dict]) -> None:
    """The same layout on one node (local Ray, 6 slots), as many steps: the same numbers (constant lr: a longer
    run's first steps do not depend on its length)."""
    logs = tmp_path / "one_node"
    one = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
                          "cluster.nnodes=1", "cluster.n_gpus_per_node=6", f"trainer.total_training_steps={len(multi)}",
                          f"trainer.log_dir={logs}", f"trainer.default_local_dir={tmp_path / 'one_ckpt'}",
                          *LAYOUT], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert one.returncode == 0, one.stderr[-4000:]
    single = [r for r in _records(logs / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [r["step"] for r in single] == [r["step"] for r in multi]
    assert {r["node"] for r in json.loads((logs / "placement.json").read_text())} == {
        json.loads((logs / "placement.json").read_text())[0]["node"]}
    for m, s in zip(multi, single):
        for key in COMPARED:
            assert key in m and key in s, (key, sorted(m))
            assert m[key] == pytest.approx(s[key], rel=1e-5, abs=1e-7), (m["step"], key, m[key], s[key])


def test_three_nodes_equal_one_node_then_a_killed_node_is_named_and_the_job_resumes_on_the_two_left(netns_cluster,
                                                                                                     tmp_path,
                                                                                                     record_property):
    """The first run has the three nodes (DP3): Ray's head on node0 and a worker from each other node; each TP group
    inside one node, the DP replicas across the three (``_check_placement``); its steps 1-2 equal the same layout run
    on one node (``_equal_one_node``, checked at the end). node2 is killed once the step-2 checkpoint is written: the run's batch
    script ends within 60 s with a line naming node2 and the ranks it held, nothing of that run is left on the other
    nodes, and the job requeues itself (ray_on_slurm.sh, MPPO_REQUEUE_ON_NODE_LOSS). Slurm keeps the job COMPLETING
    until node2 is declared DOWN (SlurmdTimeout 30 s); once it is PENDING again it is given 2 nodes (`scontrol
    update JobId=<id> NumNodes=2-2 NumTasks=2 NumCPUs=4`, what an operator does for a node gone for good (plain
    `NumNodes=2` leaves the job pending on BadConstraints); Slurm 22.05 gives a
    `--nodes=2-3` job 2 nodes even with 3 idle, its task count following the minimum) and runs on node0 and node1:
    cluster.nnodes follows the allocation (slurm/ppo_tiny.sh), the run resumes from global_step_2 at DP2 (the
    checkpoint resharded from DP3) and finishes steps 3-4."""
    seen: list = []
    phase = phase_recorder(record_property)
    job_id, run_dir, out = _submit(netns_cluster, tmp_path, 4, "trainer.save_freq=2")
    manifest = run_dir / "checkpoints" / "global_step_2" / "manifest.json"
    deadline = time.monotonic() + 600
    while not manifest.exists():
        text = out.read_text(errors="replace") if out.exists() else ""
        assert time.monotonic() < deadline, f"no step-2 checkpoint:\n{text[-4000:]}"
        assert netns_cluster.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), text[-4000:]
        time.sleep(0.5)
    phase("to_step_2_checkpoint")
    first = json.loads((run_dir / "logs" / "placement.json").read_text())
    _check_placement(first, netns_cluster)
    assert "Ray cluster up: joined: node0 node1 node2" in out.read_text(errors="replace")
    multi = [r for r in _records(run_dir / "logs" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [r["step"] for r in multi] == [1, 2]
    victim = netns_cluster.net.node("node2")
    killed = netns_cluster.net.kill_node(victim)
    t0 = time.monotonic()
    assert killed
    # the run ends by its own teardown, or by Slurm cancelling it DUE TO NODE FAILURE once node2 is declared DOWN
    # (SlurmdTimeout 30 s), which kills the batch script in the middle of its teardown (node2's srun step does not
    # end on SIGTERM: its node is gone); Slurm then requeues the job itself
    while not any(end in (text := out.read_text(errors="replace")) for end in ("teardown done (exit ",
                                                                               "DUE TO NODE FAILURE")):
        assert time.monotonic() - t0 < 60, f"the run still goes on 60 s after node2 died\n{text[-4000:]}"
        time.sleep(0.2)
    took = time.monotonic() - t0
    assert "teardown done (exit 0)" not in text, text[-4000:]
    assert f"node node2 ({victim.addr}) lost" in text, text[-5000:]
    # the ranks node2 held, from the run's own table (Ray's PACK picks which node gets bundle 0)
    held = {role: sorted(r["rank"] for r in first if r["role"] == role and r["node"] == "node2")
            for role in ("actor", "critic")}
    assert all(len(v) == 2 and v[1] == v[0] + 1 for v in held.values()), held  # one TP group of each role
    assert (f"it held actor ranks {held['actor'][0]}-{held['actor'][1]}; "
            f"critic ranks {held['critic'][0]}-{held['critic'][1]}") in text, text[-5000:]
    # Nothing of the run may be left. Teardown's cleanup steps (`timeout 15 srun ...`, one per node) are bounded at
    # 15 s; when Slurm cancels the batch script DUE TO NODE FAILURE during teardown's `wait`, they finish on their
    # own within that bound (seen in CI under load): wait for them as long as the bound, not a fixed 2 s.
    deadline = time.monotonic() + 20
    while (left := processes_naming(f"/tmp/ray-{job_id}-0-")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [p.cmdline()[:3] for p in left]

    try:
        # COMPLETING until node2 is DOWN, then PENDING (Restarts=1), held back 120 s by Slurm: released now, on 2
        phase("kill_to_teardown")
        requeued = netns_cluster.release_requeued(job_id, out, 180, "NumNodes=2-2", "NumTasks=2", "NumCPUs=4")
        phase("to_requeued")
        state = netns_cluster.wait_done(job_id, timeout=600, seen=seen)
        phase("resumed_run")
    finally:
        netns_cluster.restart_node("node2")  # a fresh slurmd: node2 back for the next test
    text = out.read_text(errors="replace")
    assert state in ("COMPLETED", "GONE"), (state, seen, text[-5000:])
    assert "run 1 of job" in text and "nodes: node0 node1 (head node0)" in text, (seen, text[-5000:])
    assert "resumed from" in text and "global_step_2" in text, text[-5000:]
    second = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert {r["node"] for r in second} == {"node0", "node1"} and len(second) == 8, second
    assert {r["dp"] for r in second if r["role"] == "actor"} == {0, 1}, second
    steps = [r["step"] for r in _records(run_dir / "logs" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert steps[:2] == [1, 2] and steps[-2:] == [3, 4], steps
    assert (run_dir / "checkpoints" / "global_step_4" / "manifest.json").exists()
    print(f"job {job_id}: node2 killed ({len(killed)} processes), first run ended {took:.0f} s later; requeued "
          f"{requeued}; then {seen}; resumed on node0 node1 at DP2 and finished")
    phase("restart_node2_and_checks")
    _equal_one_node(tmp_path, multi)
    phase("one_node_reference")


def test_a_node_that_never_joins_is_named_within_the_join_timeout(netns_cluster, tmp_path):
    """node2's link is down when the job starts (Slurm has not noticed yet): its Ray worker cannot reach the head;
    the bring-up names node2 once MPPO_RAY_JOIN_TIMEOUT (20 s here) has passed, the job fails, nothing is left
    (--no-requeue: Slurm may declare node2 DOWN while the job still runs)."""
    victim = netns_cluster.net.node("node2")
    root, out = tmp_path / "runs", tmp_path / "job.out"
    netns_cluster.net.link_down(victim)
    try:
        r = netns_cluster.run("sbatch", "--parsable", "--nodes=3", "--no-requeue", f"--output={out}",
                              f"--export=ALL,MPPO_RUN_ROOT={root},MPPO_RAY_JOIN_TIMEOUT=20", "slurm/ppo_tiny.sh",
                              "cluster.nnodes=3", "cluster.n_gpus_per_node=2", cwd=REPO)
        job_id = r.stdout.strip().split(";")[0]
        started = None
        deadline = time.monotonic() + 120
        while started is None:
            text = out.read_text(errors="replace") if out.exists() else ""
            if "waiting up to 20 s" in text:
                started = time.monotonic()
            assert time.monotonic() < deadline, f"{netns_cluster.job_state(job_id)}\n{text[-3000:]}"
            time.sleep(0.2)
        # the job ends either by its own teardown or, when Slurm has already given up on node2 (a failed srun launch
        # there; seen after the previous test restarted node2's slurmd), by Slurm cancelling it DUE TO NODE FAILURE,
        # which kills the batch script before its teardown can say so
        while "teardown done (exit " not in (text := out.read_text(errors="replace")):
            if netns_cluster.job_state(job_id) in FINAL_STATES:
                text = out.read_text(errors="replace")
                break
            # 20 s of join wait, then teardown's bounds (10 s for the Ray steps, 15 s for the cleanup), and slack for
            # a loaded CI machine (34 s here alone)
            assert time.monotonic() - started < 90, f"the job still runs 90 s after its join wait began\n{text}"
            time.sleep(0.2)
        took = time.monotonic() - started
        state = netns_cluster.wait_done(job_id, timeout=150)
    finally:
        netns_cluster.net.link_up(victim)
    assert "Ray cluster incomplete after 20 s: missing: node2" in text, text[-4000:]
    # the job's record may already have aged out (MinJobAge=2 s in the test cluster): GONE
    assert "teardown done (exit 0)" not in text and state in ("FAILED", "NODE_FAIL", "CANCELLED", "GONE"), \
        (state, text[-3000:])
    assert "driver pid" not in text  # the driver never started
    time.sleep(2)
    assert not processes_naming(f"/tmp/ray-{job_id}-"), [p.cmdline()[:3] for p in processes_naming(f"/tmp/ray-{job_id}-")]
    # node2 back for whatever runs next: Slurm marked it DOWN while its link was down; a fresh slurmd registers
    netns_cluster.net.kill_node(victim)
    netns_cluster.restart_node("node2")
    print(f"job {job_id}: node2 unreachable, named {took:.0f} s after the join wait began ({state})")
