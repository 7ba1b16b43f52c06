"""The planner's communication terms (megatron_ppo/plan/comm.py) against hand numbers: ring factors, which link a
group uses, zero where a dimension is 1, and that `step_time`'s total includes them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan import comm
from megatron_ppo.plan.memory import Hardware, Layout

LLAMA3_70B = ModelArch(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=8192)
HW = Hardware()  # NVLink 450 GB/s, 50 GB/s between nodes, no DP overlap
NV, IB = 450e9, 50e9


@pytest.mark.parametrize("n, all_reduce, half", [(1, 0.0, 0.0), (2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875),
                                                 (16, 1.875, 0.9375)])
def test_ring_factors(n, all_reduce, half):
    """A ring all-reduce moves 2(n-1)/n of the message per rank; all-gather and reduce-scatter (n-1)/n each."""
    assert comm.ring_factor("all_reduce", n) == pytest.approx(all_reduce)
    assert comm.ring_factor("all_gather", n) == comm.ring_factor("reduce_scatter", n) == pytest.approx(half)
    with pytest.raises(ValueError):
        comm.ring_factor("broadcast", n)


@pytest.mark.parametrize("ranks, per_node, spans", [(8, 8, False), (4, 8, False), (16, 8, True), (3, 8, True),
                                                    (2, 2, False), (4, 2, True)])
def test_which_link(ranks, per_node, spans):
    assert comm.spans_nodes(ranks, per_node) is spans
    assert comm.bandwidth(ranks, per_node, HW) == (IB if spans else NV)


def test_tp_by_hand_inside_a_node_and_across_nodes():
    """TP8 inside a node: 2 all-reduces per layer per pass of tokens x h x e, ring 2(t-1)/t, NVLink; the same
    layout on 4-GPU nodes splits every TP group over 2 nodes and runs at the network's 50 GB/s."""
    lay, tokens, e = Layout(tp=8, pp=4, dp=4, sp=True), 131072, 2
    got = comm.tp_seconds(LLAMA3_70B, lay, tokens, 3, 4, e, HW, 8)
    by_hand = 3 * 2 * 20 * tokens * 8192 * e * (2 * 7 / 8) / NV * (1 + 3 / 4)
    assert got == pytest.approx(by_hand, rel=1e-12)
    split = comm.tp_seconds(LLAMA3_70B, lay, tokens, 3, 4, e, HW, 4)
    assert split == pytest.approx(by_hand * NV / IB, rel=1e-12)
    assert comm.tp_seconds(LLAMA3_70B, dataclasses.replace(lay, tp=1), tokens, 3, 4, e, HW, 8) == 0.0
    # sequence parallelism moves the same bytes (all-gather + reduce-scatter = all-reduce)
    assert comm.tp_seconds(LLAMA3_70B, dataclasses.replace(lay, sp=False), tokens, 3, 4, e, HW, 8) == got


def test_pp_by_hand():
    """Per micro-batch and direction one s b h e message (/TP with SP), x the fill/drain (1 + (p-1)/m); the
    pipeline of 128 ranks on 8-GPU nodes crosses nodes; PP1 moves nothing."""
    lay, e = Layout(tp=8, pp=4, dp=4, sp=True), 2
    micro_tokens, tokens, m = 8 * 1024, 131072, 4
    got = comm.pp_seconds(LLAMA3_70B, lay, tokens, micro_tokens, 2, m, e, HW, 8)
    message = micro_tokens * 8192 * e / 8
    assert got == pytest.approx(tokens / micro_tokens * 2 * (1 + 3 / 4) * message / IB, rel=1e-12)
    no_sp = comm.pp_seconds(LLAMA3_70B, dataclasses.replace(lay, sp=False), tokens, micro_tokens, 2, m, e, HW, 8)
    assert no_sp == pytest.approx(8 * got)
    assert comm.pp_seconds(LLAMA3_70B, dataclasses.replace(lay, pp=1), tokens, micro_tokens, 2, m, e, HW, 8) == 0.0
    one_node = Layout(tp=2, pp=2, dp=2)  # 8 ranks on one 8-GPU node: NVLink
    assert comm.pp_seconds(LLAMA3_70B, one_node, tokens, micro_tokens, 1, m, e, HW, 8) == pytest.approx(
        tokens / micro_tokens * (1 + 1 / 4) * micro_tokens * 8192 * e / NV, rel=1e-12)


def test_dp_by_hand():
    """Distributed optimizer: reduce-scatter fp32 grads + all-gather bf16 params, (d-1)/d each; without it an
    all-reduce of the grads, 2(d-1)/d; inside a node when TP x DP fits one; DP1 moves nothing; dp_overlap hides
    its share."""
    params, steps = 2_000_000_000, 4
    dist = Layout(tp=8, pp=4, dp=4, distributed_optimizer=True)
    got = comm.dp_seconds(params, dist, steps, 2, 4, HW, 8)
    assert got == pytest.approx(steps * params * (4 + 2) * 3 / 4 / IB, rel=1e-12)  # TP8 x DP4 = 32 ranks: network
    rep = dataclasses.replace(dist, distributed_optimizer=False)
    assert comm.dp_seconds(params, rep, steps, 2, 4, HW, 8) == pytest.approx(steps * params * 4 * 2 * 3 / 4 / IB)
    inside = Layout(tp=2, pp=1, dp=4)
    assert comm.dp_seconds(params, inside, 1, 2, 4, HW, 8) == pytest.approx(params * 6 * 3 / 4 / NV)
    assert comm.dp_seconds(params, dataclasses.replace(dist, dp=1), steps, 2, 4, HW, 8) == 0.0
    assert comm.dp_seconds(params, dist, 0, 2, 4, HW, 8) == 0.0
    half = dataclasses.replace(HW, dp_overlap=0.5)
    assert comm.dp_seconds(params, dist, steps, 2, 4, half, 8) == pytest.approx(got / 2)
    with pytest.raises(ValueError):
        Hardware(dp_overlap=1.5)


def test_generation_comm_by_hand():
    lay = Layout(tp=8, pp=4, dp=4, sp=True)
    got = comm.generate_seconds(LLAMA3_70B, lay, 128 * 1024, 2, HW, 8)
    assert got["tp"] == pytest.approx(2 * 80 * 128 * 1024 * 8192 * 2 * 1.75 / NV, rel=1e-12)
    assert got["pp"] == pytest.approx(3 * 128 * 1024 * 8192 * 2 / IB, rel=1e-12)
    assert comm.generate_seconds(LLAMA3_70B, Layout(), 1000, 2, HW, 8) == {"tp": 0.0, "pp": 0.0, "dp": 0.0}


def _specs(config: str, overrides=()):
    from megatron_ppo.config import load_config
    from megatron_ppo.plan.layouts import role_specs, with_world

    cfg = load_config(config, list(overrides))
    gpus = cfg.cluster.world_size
    return with_world(role_specs(cfg, gpus), gpus), gpus, min(cfg.cluster.n_gpus_per_node, gpus)


def test_step_time_total_includes_the_communication():
    from megatron_ppo.plan.layouts import comm_times, step_time

    specs, gpus, per_node = _specs("ppo_70b")
    t = step_time(specs, gpus, HW, per_node)
    c = comm_times(specs, HW, per_node)
    phases = ["old_log_prob", "actor_update", "values", "critic_update", "ref_log_prob", "generate"]
    assert set(c) == set(phases)
    for p in phases:
        assert t[f"{p}_comm"] == pytest.approx(sum(c[p].values()))
    assert t["comm"] == pytest.approx(sum(t[f"{p}_comm"] for p in phases)) and t["comm"] > 0
    assert t["step"] == pytest.approx(sum(t[p] for p in phases) + t["comm"], rel=1e-12)
    assert t["tokens_per_s"] == pytest.approx(512 * 1024 / t["step"])
    # the update's DP term: 4 optimizer steps (512 / 128 sequences), the actor's worst-stage parameters
    from megatron_ppo.plan.memory import memory
    a = specs["actor"]
    params = memory(a.arch, "actor", a.layout, a.work).params
    assert c["actor_update"]["dp"] == pytest.approx(4 * params * 6 * 3 / 4 / IB, rel=1e-12)
    assert c["ref_log_prob"]["dp"] == 0.0
    # infinitely fast links: the step is the compute alone; a slower network: a longer step
    fast = step_time(specs, gpus, dataclasses.replace(HW, intra_node_gbs=1e12, inter_node_gbs=1e12), per_node)
    assert fast["comm"] < 1e-6 and fast["step"] == pytest.approx(t["step"] - t["comm"], rel=1e-6)
    slow = step_time(specs, gpus, dataclasses.replace(HW, inter_node_gbs=25.0), per_node)
    assert slow["step"] > t["step"] and slow["actor_update_comm"] > t["actor_update_comm"]


def test_single_gpu_layout_has_no_communication():
    from megatron_ppo.plan.layouts import step_time

    specs, gpus, per_node = _specs("tiny_cpu", ["cluster.nnodes=1", "cluster.n_gpus_per_node=1",
                                                *(f"cluster.{r}.tensor_model_parallel_size=1" for r in ("actor", "ref"))])
    t = step_time(specs, 1, HW, 1)
    assert t["comm"] == 0.0 and t["step"] > 0


def test_plan_prints_and_exports_the_communication(capsys):
    from megatron_ppo.plan.cli import main

    assert main(["--config", "ppo_70b", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["hardware"]["intra_node_gbs"] == 450.0 and d["hardware"]["inter_node_gbs"] == 50.0
    assert d["step_time_s"]["actor_update_comm"] == pytest.approx(sum(d["comm_s"]["actor_update"].values()))
    assert "megatron" in d["weight_sync"] and "not overlapped" in d["comm_assumptions"]
    main(["--config", "ppo_70b", "--inter-node-gbs", "25", "--json"])
    slower = json.loads(capsys.readouterr().out)
    assert slower["step_time_s"]["step"] > d["step_time_s"]["step"]
    main(["--config", "ppo_70b"])
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.strip().startswith("phase "))
    assert head.split() == ["phase", "compute", "tp_comm", "pp_comm", "dp_comm", "total", "comm", "share"]
    step = next(line for line in out.splitlines() if line.strip().startswith("step "))
    assert f"{d['step_time_s']['step']:.2f}" in step
    assert "weight sync to the rollout engine: none" in out
