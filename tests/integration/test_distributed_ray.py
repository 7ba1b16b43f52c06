"""RayWorkerGroup on a real local Ray cluster with real megatron-core ranks (gloo, CPU).

* TP=2 x DP=2 forward of a tiny Megatron model equals the in-process TP=1 LocalWorkerGroup forward (same full
  state dict), rows come back in the original order, parallel_state's ranks match RankLayout, logs are prefixed;
* colocated roles share bundles with fractional CPUs; a kill -9 of one rank mid-collective fails the group within
  seconds, naming role, rank, coordinates and node, with no process left (the other role keeps working);
* a remote exception while the peer waits in a collective reaches the driver with its traceback at once
  (not after the collective timeout);
* RAY_ADDRESS connects a second driver to the running cluster; a placement Ray cannot reserve fails with the
  arithmetic instead of pending.

One Ray session for the module (4 logical CPUs on the 2-core machine; ranks set their torch threads to 1).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from megatron_ppo.distributed import (ClusterSlots, LayoutError, LocalWorkerGroup, RankLayout,  # noqa: E402
                                      RankResources, RayWorkerGroup, WorkerGroupError, connect_or_start,
                                      create_placement, plan_placement, remove_placement, split_rows)

VOCAB = 500  # padded to 512 by Megatron: exercises the vocab padding of the TP gather
COLLECTIVE_TIMEOUT_S = 60.0  # the backstop; the fail-fast tests must finish far below it


class ForwardWorker:
    """A real actor shard (tiny Llama-style GPTModel) answering what these tests ask of a rank."""

    def __init__(self, vocab: int = VOCAB):
        from megatron_ppo.models.arch import tiny_arch
        from megatron_ppo.models.gpt import build_gpt_model

        self.vocab = vocab
        self.model = build_gpt_model(tiny_arch(vocab_size=vocab), "actor")

    def full_state_dict(self) -> dict:
        from megatron_ppo.testing.sharding import gather_full_state_dict

        return gather_full_state_dict(self.model)

    def load_full(self, full: dict) -> None:
        from megatron_ppo.testing.sharding import load_full_state_dict

        load_full_state_dict(self.model, full)

    def where(self) -> dict:
        import torch.distributed as dist

        from megatron_ppo import parallel

        print(f"where: global rank {dist.get_rank()}", flush=True)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(),
                "coords": (parallel.tp_rank(), parallel.pp_rank(), parallel.dp_rank()),
                "threads": torch.get_num_threads()}

    @torch.no_grad()
    def logits(self, rows: list[list[int]]) -> dict:
        """Full-vocab logits of each row (packed THD forward, TP shards all-gathered), and who computed them."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        from megatron_ppo import parallel
        from megatron_ppo.models.forward import model_forward, pack_sequences

        self.model.eval()
        ids, cu = pack_sequences([torch.tensor(r, dtype=torch.long) for r in rows])
        out = gather_from_tensor_model_parallel_region(model_forward(self.model, {"input_ids": ids,
                                                                                  "cu_seqlens": cu}))
        out = out.reshape(ids.shape[1], -1)[:, :self.vocab].float()  # [T, vocab] (megatron returns [S, B, V])
        return {"logits": [out[int(cu[i]):int(cu[i + 1])].clone() for i in range(len(rows))],
                "dp": [parallel.dp_rank()] * len(rows)}

    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    def spin(self) -> None:
        """All-reduce forever: a step that is always inside a collective."""
        import torch.distributed as dist

        t = torch.ones(4)
        while True:
            dist.all_reduce(t)
            time.sleep(0.01)

    def fail_on(self, bad_rank: int) -> None:
        """``bad_rank`` raises; the others wait in a barrier for it (a live peer absent from a collective)."""
        import torch.distributed as dist

        if dist.get_rank() == bad_rank:
            raise ValueError(f"planted failure on rank {bad_rank}")
        dist.barrier()


def critic_output(output, micro_batch) -> dict:
    return {"values": output.detach().float().reshape(-1)}


@pytest.fixture(scope="module")
def ray_cluster():
    # the worker class above travels by value: the ranks cannot import this test module
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = connect_or_start("local", num_cpus=4)
    print(f"\nray.init (local cluster, 4 logical CPUs): {cluster.init_seconds:.1f} s")
    yield cluster
    cluster.shutdown()
    assert not os.path.exists(cluster.temp_dir), "the per-run Ray temp dir was not removed"


def _rows(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 24, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


def test_tp2_dp2_forward_equals_local_tp1_and_rows_keep_their_order(ray_cluster, capfd):
    from megatron_ppo.parallel.platform import disable_cpu_platform

    rows = _rows(10)
    local = LocalWorkerGroup("actor", ForwardWorker, seed=5)
    try:
        full = local.call_all("full_state_dict")[0]
        reference = local.call_rows("logits", rows, [len(r) for r in rows])
    finally:
        local.shutdown()
        disable_cpu_platform()

    layout = RankLayout(tp=2, pp=1, dp=2)
    plan = create_placement(plan_placement({"actor": layout}, ClusterSlots(1, 4, "CPU"), "colocated",
                                           RankResources(num_cpus=1)))
    try:
        start = time.perf_counter()
        group = RayWorkerGroup("actor", layout, plan.roles["actor"], ForwardWorker, seed=99,  # other init
                               collective_timeout_s=COLLECTIVE_TIMEOUT_S, nccl_timeout_s=1800)
        report = [f"group start, 4 ranks (TP2 x DP2): {time.perf_counter() - start:.1f} s {group.timings}"]
        try:
            # gloo keeps the fail-fast backstop (NCCL's 30 min would hold a hung peer's group that long): torch's
            # own reading of each rank's group
            assert group.group_timeout_s == [COLLECTIVE_TIMEOUT_S] * 4
            where = group.call_all("where")
            assert [w["rank"] for w in where] == [0, 1, 2, 3] and {w["world"] for w in where} == {4}
            assert [w["coords"] for w in where] == [tuple(layout.coords(r)) for r in range(4)]
            assert {w["threads"] for w in where} == {1}
            assert len({w["pid"] for w in where}) == 4 and os.getpid() not in {w["pid"] for w in where}

            group.call_all("load_full", full)
            start = time.perf_counter()
            got = group.call_rows("logits", rows, [len(r) for r in rows])
            report.append(f"call round trip (call_rows logits, 10 rows): {time.perf_counter() - start:.3f} s")
            start = time.perf_counter()
            group.call_all("where")
            report.append(f"call round trip (call_all, tiny): {time.perf_counter() - start:.3f} s")
            # dispatch_s counts the time outside the method: a 2 s nap in every rank adds only the round trip
            before = group.dispatch_s
            start = time.perf_counter()
            group.call_all("nap", 2.0)
            wall, grown = time.perf_counter() - start, group.dispatch_s - before
            report.append(f"dispatch of a 2 s call: {grown:.3f} s of {wall:.3f} s")
            assert wall >= 2.0 and 0 < grown < 1.0, (wall, grown)
        finally:
            group.shutdown()
    finally:
        remove_placement(plan)

    shards = split_rows([len(r) for r in rows], 2)
    assert got["dp"] == [d for i in range(len(rows)) for d in range(2) if i in shards[d]]  # who did each row
    assert set(got["dp"]) == {0, 1}
    worst = max(float((a - b).abs().max()) for a, b in zip(got["logits"], reference["logits"]))
    report.append(f"TP2 x DP2 vs TP1 logits: max |diff| {worst:.2e}")
    for i, (a, b) in enumerate(zip(got["logits"], reference["logits"])):
        assert a.shape == (len(rows[i]), VOCAB)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"row {i}: {m}")
    # Ray prefixes each rank's output with the actor's repr
    deadline = time.monotonic() + 15
    seen = ""
    while time.monotonic() < deadline:
        seen += capfd.readouterr().out
        if all(f"actor[{layout.coords(r)}]" in seen for r in range(4)):
            break
        time.sleep(0.5)
    with capfd.disabled():
        print("\n" + "\n".join(report))
    assert re.search(r"\(actor\[tp1 pp0 dp1\] pid=\d+\).*where: global rank 3", seen), seen[-2000:]


def test_colocated_roles_share_bundles_and_kill9_fails_fast(ray_cluster):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.forward import pack_sequences

    layouts = {"actor": RankLayout(tp=2), "critic": RankLayout(dp=2)}
    plan = create_placement(plan_placement(layouts, ClusterSlots(1, 2, "CPU"), "colocated", RankResources(1)))
    assert plan.roles["actor"].num_cpus == 0.5
    actor = critic = None
    try:
        start = time.perf_counter()
        actor = RayWorkerGroup("actor", layouts["actor"], plan.roles["actor"], ForwardWorker,
                               collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        print(f"\ngroup start, 2 ranks (TP2, 0.5 CPU each): {time.perf_counter() - start:.1f} s {actor.timings}")
        pg_id = plan.groups["colocated"].id.hex()
        free = [f"CPU_group_{bundle}_{pg_id}" for bundle in (0, 1)]
        assert [ray.available_resources().get(key, 0.0) for key in free] == [0.5, 0.5]  # actor rank r: half of r
        critic = RayWorkerGroup("critic", layouts["critic"], plan.roles["critic"],
                                "megatron_ppo.workers.megatron_worker:MegatronWorker",
                                {"role": "critic", "arch": tiny_arch()}, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                                release_heap_below_available=0.999,  # the host is always "short": every call releases
                                release_device_cache=True)  # as the driver sets it for roles sharing a GPU
        assert [ray.available_resources().get(key, 0.0) for key in free] == [0.0, 0.0]  # critic: the other halves
        for group in (actor, critic):
            infos = ray.get([a.info.remote() for a in group.actors])
            assert [(i["placement_group"], i["resources"]) for i in infos] == [(pg_id, {"CPU": 0.5})] * 2

        ids, cu = pack_sequences([torch.arange(1, 6), torch.arange(2, 9)])
        shards = [[{"input_ids": ids, "cu_seqlens": cu}], [{"input_ids": ids[:, :5], "cu_seqlens": cu[:2]}]]
        values = critic.call_dp("forward", shards, critic_output)
        assert [v[0]["values"].shape[0] for v in values] == [12, 5]
        # cluster.release_heap_below_available: a rank gives back its free heap after a call when its host is short
        # (the critic's threshold above), and never at 0 (the actor's, RayWorkerGroup's default)
        assert [i["heap_releases"] for i in ray.get([a.info.remote() for a in critic.actors])] == [1, 1]
        # a rank on a shared GPU empties its CUDA cache after every call (the platform layer's no-op on CPU: 0 bytes)
        assert [(i["cache_releases"], i["cache_released_bytes"])
                for i in ray.get([a.info.remote() for a in critic.actors])] == [(1, 0), (1, 0)]
        actor.call_all("where")
        assert [(i["heap_releases"], i["cache_releases"])
                for i in ray.get([a.info.remote() for a in actor.actors])] == [(0, 0), (0, 0)]

        pids = actor.pids()
        victim = 1
        killed_at = {}

        def kill_later():
            time.sleep(3.0)  # both ranks are inside the all-reduce loop by now
            killed_at["t"] = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)

        killer = threading.Thread(target=kill_later)
        killer.start()
        with pytest.raises(WorkerGroupError) as err:
            actor.call_all("spin")
        detected = time.monotonic() - killed_at["t"]
        killer.join()
        message = str(err.value)
        print(f"kill -9 of actor rank 1 -> WorkerGroupError after {detected:.2f} s:\n{message}")
        assert detected < 60
        node = ray.util.get_node_ip_address()
        assert message.startswith(f"actor rank 1 (tp1 pp0 dp0) on node {node} pid {pids[1]} died during 'spin'")
        assert "actor rank 0 (tp0 pp0 dp0)" in message  # its peer's gloo error is listed too
        assert type(err.value) is WorkerGroupError  # its node answers: not NodeLostError (no requeue, exit 1)
        for pid in pids:  # group.shutdown waited for the processes: none may be left
            assert not _alive(pid), f"rank process {pid} survived"
        table = ray._private.state.actors()  # the GCS actor table (the state API would need the dashboard)
        assert [table[a._actor_id.hex()]["State"] for a in actor.actors] == ["DEAD", "DEAD"]
        with pytest.raises(WorkerGroupError, match="shut down"):
            actor.call_all("where")
        # the colocated critic has its own processes and process group: untouched
        again = critic.call_dp("forward", shards, critic_output)
        torch.testing.assert_close(again[0][0]["values"], values[0][0]["values"])
    finally:
        for group in (actor, critic):
            if group is not None:
                group.shutdown()
        remove_placement(plan)


def test_remote_exception_reaches_driver_with_traceback_before_the_collective_timeout(ray_cluster):
    layout = RankLayout(dp=2)
    plan = create_placement(plan_placement({"ref": layout}, ClusterSlots(1, 4, "CPU"), "split", RankResources(1)))
    try:
        group = RayWorkerGroup("ref", layout, plan.roles["ref"], ForwardWorker,
                               collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        pids = group.pids()
        start = time.monotonic()
        with pytest.raises(WorkerGroupError) as err:
            group.call_all("fail_on", 1)
        elapsed = time.monotonic() - start
        message = str(err.value)
        print(f"\nremote ValueError on ref rank 1 -> WorkerGroupError after {elapsed:.2f} s:\n{message}")
        assert elapsed < 15, "the driver waited for the collective timeout instead of failing fast"
        node = ray.util.get_node_ip_address()
        assert message.startswith(f"ref rank 1 (tp0 pp0 dp1) on node {node} pid {pids[1]} raised ValueError: "
                                  "planted failure on rank 1 (in 'fail_on')")
        assert "remote traceback of ref rank 1 (tp0 pp0 dp1)" in message
        assert re.search(r'File ".*test_distributed_ray.py", line \d+, in fail_on', message)  # the remote frames
        assert "\x1b[" not in message  # Ray's terminal colours are stripped
        assert "ref ranks [0] had not answered" in message
        assert isinstance(err.value.__cause__, ValueError)  # Ray's RayTaskError(ValueError)
        for pid in pids:
            assert not _alive(pid)
    finally:
        remove_placement(plan)


def test_ray_address_connects_a_second_driver_and_unreservable_placement_fails(ray_cluster):
    code = ("from megatron_ppo.distributed import connect_or_start; import ray; c = connect_or_start(); "
            "print('started_here', c.started_here, 'cpus', ray.cluster_resources()['CPU']); c.shutdown()")
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.address)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "started_here False cpus 4.0" in out.stdout
    assert ray.cluster_resources()["CPU"] == 4  # the second driver's shutdown left our cluster up

    plan = plan_placement({"actor": RankLayout(dp=8)}, ClusterSlots(1, 8, "CPU"), "colocated")  # config lies
    start = time.monotonic()
    with pytest.raises(LayoutError, match=r"could not reserve 8 bundles of \{'CPU': 1.0\} \(PACK\) within 2 s"):
        create_placement(plan, ready_timeout_s=2)
    assert time.monotonic() - start < 20
    assert not plan.groups  # the pending group was removed


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
