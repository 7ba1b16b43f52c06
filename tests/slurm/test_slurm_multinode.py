"""Several nodes (issue 27): `sbatch --nodes=3 slurm/ppo_tiny.sh` on three network-namespace nodes
(megatron_ppo/testing/netns_cluster.py: an address, hostname and slurmd each; slurmctld on node0). Ray's head runs on
node0 and a worker joins from each other node; every role is TP2 x DP3, so each TP group must sit inside one node
and the DP replicas span the three; gloo rendezvous with MASTER_ADDR on another host. Its metrics equal the same
layout run on one node. A node killed mid-run ends the job within 60 s with a line naming the node and the ranks it
held, and nothing of the job is left on the other nodes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import processes_naming

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# actor and critic TP2 x DP3 on 3 nodes of 2 slots; 12 prompts: 4 per DP replica, mini-batches of 6 prompts (2 a
# replica); no KL loss, so no reference role: 12 ranks, not 18 (each rank's start-up costs ~5 s of the 2 cores)
LAYOUT = ("cluster.critic.tensor_model_parallel_size=2", "data.train_batch_size=12", "actor.use_kl_loss=false",
          "actor.ppo_mini_batch_size=6", "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=6",
          "critic.ppo_micro_batch_size_per_gpu=2", "ref.log_prob_micro_batch_size_per_gpu=2",
          "rollout.log_prob_micro_batch_size_per_gpu=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
          "trainer.seed=7")
COMPARED = ("reward/score/mean", "response_length/mean", "actor/entropy", "actor/pg_loss", "actor/ppo_kl",
            "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/returns/mean")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _submit(cluster, tmp_path: Path, steps: int, *extra: str, sbatch: tuple = ()) -> tuple[str, Path, Path]:
    root, out = tmp_path / "runs", tmp_path / "job.out"
    r = cluster.run("sbatch", "--parsable", "--nodes=3", *sbatch, f"--output={out}",
                    f"--export=ALL,MPPO_RUN_ROOT={root}", "slurm/ppo_tiny.sh", "cluster.nnodes=3", "cluster.n_gpus_per_node=2",
                    f"trainer.total_training_steps={steps}", *LAYOUT, *extra, cwd=REPO)
    job_id = r.stdout.strip().split(";")[0]
    return job_id, root / f"mppo-tiny-{job_id}", out


def test_three_nodes_tp_inside_a_node_dp_across_equal_one_node(netns_cluster, tmp_path):
    job_id, run_dir, out = _submit(netns_cluster, tmp_path, 2)
    state = netns_cluster.wait_done(job_id, timeout=900)
    text = out.read_text(errors="replace") if out.exists() else ""
    assert state in ("COMPLETED", "GONE") and "driver exited with 0" in text, f"{state}\n{text[-5000:]}"
    assert "Ray cluster up: joined: node0 node1 node2" in text, text[-3000:]

    # where the ranks ran: each node holds one TP group (ranks 2d, 2d+1 = DP replica d) of every role
    table = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert len(table) == 12 and {r["node"] for r in table} == {"node0", "node1", "node2"}, table
    addr = {n.name: n.addr for n in netns_cluster.nodes}
    for role in ("actor", "critic"):
        rows = sorted((r for r in table if r["role"] == role), key=lambda r: r["rank"])
        assert [(r["tp"], r["dp"]) for r in rows] == [(t, d) for d in range(3) for t in range(2)], rows
        for d in range(3):
            tp_group = [r for r in rows if r["dp"] == d]
            assert len({r["node"] for r in tp_group}) == 1, f"{role} TP group of DP replica {d} spans nodes: {rows}"
            assert all(r["ip"] == addr[r["node"]] for r in tp_group), (tp_group, addr)
        assert len({r["node"] for r in rows}) == 3, f"{role}'s DP replicas are not on three nodes: {rows}"
    # colocated: rank r of every role on the same node
    by_rank = {}
    for r in table:
        by_rank.setdefault(r["rank"], set()).add(r["node"])
    assert all(len(nodes) == 1 for nodes in by_rank.values()), by_rank

    multi = [r for r in _records(run_dir / "logs" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [r["step"] for r in multi] == [1, 2]

    # the same layout on one node (local Ray, 6 slots): the same numbers
    logs = tmp_path / "one_node"
    one = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
                          "cluster.nnodes=1", "cluster.n_gpus_per_node=6", "trainer.total_training_steps=2",
                          f"trainer.log_dir={logs}", f"trainer.default_local_dir={tmp_path / 'one_ckpt'}",
                          *LAYOUT], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert one.returncode == 0, one.stderr[-4000:]
    single = [r for r in _records(logs / "metrics.jsonl") if "actor/pg_loss" in r]
    assert {r["node"] for r in json.loads((logs / "placement.json").read_text())} == {
        json.loads((logs / "placement.json").read_text())[0]["node"]}
    for m, s in zip(multi, single):
        for key in COMPARED:
            assert key in m and key in s, (key, sorted(m))
            assert m[key] == pytest.approx(s[key], rel=1e-5, abs=1e-7), (m["step"], key, m[key], s[key])


def test_a_killed_node_ends_the_job_within_60_s_naming_it(netns_cluster, tmp_path):
    """No requeue onto the nodes that are left: the job asks for exactly 3 nodes (TP2 x DP3 on 2 slots each), so a
    requeued job would wait for a third node; resuming on 2 would be a `--nodes=2-3` job whose run restarts at DP2
    from a DP3 checkpoint (cluster.nnodes from the allocation, a resharding resume), not built yet. Submitted with
    --no-requeue: Slurm declares the node DOWN ~30 s after its death (SlurmdTimeout) and would requeue a job still
    running then. The job's end is its batch script's end (teardown's last line); Slurm keeps the job COMPLETING
    until the dead node is declared DOWN, then FAILED or NODE_FAIL."""
    job_id, run_dir, out = _submit(netns_cluster, tmp_path, 200, sbatch=("--no-requeue",))
    metrics = run_dir / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not any("actor/pg_loss" in r for r in _records(metrics)):
        text = out.read_text(errors="replace") if out.exists() else ""
        assert time.monotonic() < deadline, f"no step logged:\n{text[-4000:]}"
        assert netns_cluster.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), text[-4000:]
        time.sleep(0.5)
    victim = netns_cluster.net.node("node2")
    killed = netns_cluster.net.kill_node(victim)
    t0 = time.monotonic()
    assert killed
    while "teardown done (exit " not in (text := out.read_text(errors="replace")):
        assert time.monotonic() - t0 < 60, f"the job still runs 60 s after node2 died\n{text[-4000:]}"
        time.sleep(0.2)
    took = time.monotonic() - t0
    assert "teardown done (exit 0)" not in text, text[-4000:]
    state = netns_cluster.wait_done(job_id, timeout=150)
    assert state in ("FAILED", "NODE_FAIL"), (state, text[-3000:])
    assert f"node node2 ({victim.addr}) lost" in text, text[-5000:]
    # the ranks node2 held, from the run's own table (Ray's PACK picks which node gets bundle 0)
    table = json.loads((run_dir / "logs" / "placement.json").read_text())
    held = {role: sorted(r["rank"] for r in table if r["role"] == role and r["node"] == "node2")
            for role in ("actor", "critic")}
    assert all(len(v) == 2 and v[1] == v[0] + 1 for v in held.values()), held  # one TP group of each role
    assert (f"it held actor ranks {held['actor'][0]}-{held['actor'][1]}; "
            f"critic ranks {held['critic'][0]}-{held['critic'][1]}") in text, text[-5000:]
    time.sleep(2)
    left = processes_naming(f"/tmp/ray-{job_id}-") + processes_naming(str(run_dir))
    assert not left, [p.cmdline()[:3] for p in left]
    print(f"job {job_id}: node2 killed ({len(killed)} processes), job {state} {took:.0f} s later")
    netns_cluster.restart_node("node2")  # a fresh slurmd: node2 back for the next test


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
        while "teardown done (exit " not in (text := out.read_text(errors="replace")):
            assert time.monotonic() - started < 60, f"the job still runs 60 s after its join wait began\n{text}"
            time.sleep(0.2)
        took = time.monotonic() - started
        state = netns_cluster.wait_done(job_id, timeout=150)
    finally:
        netns_cluster.net.link_up(victim)
    assert "Ray cluster incomplete after 20 s: missing: node2" in text, text[-4000:]
    assert "teardown done (exit 0)" not in text and state in ("FAILED", "NODE_FAIL"), (state, text[-3000:])
    assert "driver pid" not in text  # the driver never started
    time.sleep(2)
    assert not processes_naming(f"/tmp/ray-{job_id}-"), [p.cmdline()[:3] for p in processes_naming(f"/tmp/ray-{job_id}-")]
    # node2 back for whatever runs next: Slurm marked it DOWN while its link was down; a fresh slurmd registers
    netns_cluster.net.kill_node(victim)
    netns_cluster.restart_node("node2")
    print(f"job {job_id}: node2 unreachable, named {took:.0f} s after the join wait began ({state})")
