"""The planner's weight sync to vLLM (megatron_ppo/plan/comm.py vllm_engines / weight_sync_seconds, plan/cli.py):
the engines a layout gets, each term against a hand count on a small model, and ppo_70b's plan (engines of TP8
over 8 GPUs, a planned sync of at most 10 s: issue 48's goal). No model is built."""
from __future__ import annotations

import json

import pytest

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan import comm
from megatron_ppo.plan.memory import Hardware, Layout

# 4 layers, hidden 64, 4 heads of 16, 2 KV groups, ffn 128, vocab 1000, untied: a layer has
# 64 x (64 + 64) (QKV) + 64 x 64 (proj) + 3 x 64 x 128 (SwiGLU) + 2 x 64 (norms) = 36,992 parameters
SMALL = ModelArch(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  vocab_size=1000, max_position_embeddings=256, tie_word_embeddings=False)
E = 2
S0 = (2 * 36992 + 1000 * 64) * E           # stage 0: two layers + the embedding
S1 = (2 * 36992 + 64 + 1000 * 64) * E      # stage 1: two layers + the final norm + the LM head
B = S0 + S1
HW = Hardware()
NV, IB, HBM, PCIE = 450e9, 50e9, 3.35e12, 50e9


def test_stage_bytes_add_up_to_the_model():
    assert comm.hf_stage_bytes(SMALL, 2, E) == [S0, S1]
    assert sum(comm.hf_stage_bytes(SMALL, 1, E)) == SMALL.num_parameters() * E == B
    tied = SMALL.replace(tie_word_embeddings=True)  # exported once, by the first stage
    assert sum(comm.hf_stage_bytes(tied, 2, E)) == tied.num_parameters() * E == B - 64000 * E
    assert comm.largest_tensor_bytes(SMALL, E) == 1000 * 64 * E  # the embedding beats fc1's 2 x 128 x 64


def test_engines_follow_the_rank_order():
    """rank = tp + TP*dp + TP*DP*pp, nodes filled in rank order: TP2 PP2 DP1 on 2-GPU nodes puts each stage on its
    own node (two TP2 engines); on a 4-GPU node both stages share it (one TP4 engine, or TP2 x PP2)."""
    lay = Layout(tp=2, pp=2, dp=1)
    assert comm.vllm_engines(lay, 2) == [comm.Engine(0, 0, (0,), 2, 1), comm.Engine(0, 1, (1,), 2, 1)]
    assert comm.vllm_engines(lay, 4) == [comm.Engine(0, 0, (0, 1), 4, 1)]
    assert comm.vllm_engines(lay, 4, None, 2) == [comm.Engine(0, 0, (0, 1), 2, 2)]
    # ppo_70b: TP8 PP4 DP4 on 8-GPU nodes: replica r's stage s on node r + 4 s, 16 engines of TP8
    big = comm.vllm_engines(Layout(tp=8, pp=4, dp=4), 8)
    assert len(big) == 16 and {e.tp for e in big} == {8} and sorted(e.node for e in big) == list(range(16))
    assert [e.node for e in big if e.replica == 1] == [1, 5, 9, 13]
    with pytest.raises(ValueError, match="tensor_model_parallel_size 2 x pipeline_model_parallel_size 1 = 2 GPUs, "
                                         "but actor replica 0 holds 4 GPUs on node 0"):
        comm.vllm_engines(lay, 4, 2, 1)
    with pytest.raises(ValueError, match="span nodes"):
        comm.vllm_engines(Layout(tp=4), 2)


def test_ipc_sync_by_hand_across_nodes():
    """Each stage on its own node: gather (t-1)/t of a stage to tp0 over NVLink; each tp0 sends its stage to the
    other owner and receives the other stage over the network; the owner serves (n-1)/n of the model over NVLink;
    packs the model into buckets (read + write of B in HBM). The sum is the total."""
    lay = Layout(tp=2, pp=2, dp=1)
    got = comm.weight_sync_seconds(SMALL, lay, comm.vllm_engines(lay, 2), 2, HW, "ipc", 4096, E)
    want = {"gather": S1 / 2 / NV, "relay": S1 / IB, "ipc": B / 2 / NV, "hbm": 2 * B / HBM}
    assert got["terms"] == pytest.approx(want, rel=1e-12)
    assert got["total"] == pytest.approx(sum(want.values()), rel=1e-12)
    assert got["bytes"]["relay_network"] == S1 and got["bytes"]["relay_nvlink"] == 0
    assert got["extra_gpu_bytes"] == 4096 + 1000 * 64 * E  # the embedding exceeds the bucket: it travels alone
    big_bucket = comm.weight_sync_seconds(SMALL, lay, comm.vllm_engines(lay, 2), 2, HW, "ipc", 1 << 20, E)
    assert big_bucket["extra_gpu_bytes"] == 1 << 20


def test_ipc_sync_by_hand_inside_a_node():
    """Both stages on one 4-GPU node: the owner is stage 1's tp0 (the node's last stage, as
    rollout/vllm_layout.py), stage 0's tp0 hands it its stage over NVLink; a TP4 engine."""
    lay = Layout(tp=2, pp=2, dp=1)
    got = comm.weight_sync_seconds(SMALL, lay, comm.vllm_engines(lay, 4), 4, HW, "ipc", 4096, E)
    assert got["bytes"]["relay_nvlink"] == S0 and got["bytes"]["relay_network"] == 0
    assert got["terms"] == pytest.approx({"gather": S1 / 2 / NV, "relay": S0 / NV, "ipc": 3 * B / 4 / NV,
                                          "hbm": 2 * B / HBM}, rel=1e-12)


def test_file_sync_by_hand():
    """File transport: gather, the stage to the host over PCIe, written at the file system's rate, the whole model
    read back per engine, each GPU's 1/n over PCIe; tmpfs or a shared file system (assumed rates)."""
    lay = Layout(tp=2, pp=2, dp=1)
    engines = comm.vllm_engines(lay, 2)
    for shared, fs in ((False, HW.tmpfs_gbs * 1e9), (True, HW.shared_fs_gbs * 1e9)):
        got = comm.weight_sync_seconds(SMALL, lay, engines, 2, HW, "file", 4096, E, shared_fs=shared)
        assert got["terms"] == pytest.approx({"gather": S1 / 2 / NV, "d2h": S1 / PCIE, "write": S1 / fs,
                                              "read": B / fs, "h2d": B / 2 / PCIE}, rel=1e-12)
    with pytest.raises(ValueError):
        comm.weight_sync_seconds(SMALL, lay, engines, 2, HW, "nccl", 4096, E)


def _plan(capsys, *args):
    from megatron_ppo.plan.cli import main

    rc = main(["--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_ppo_70b_plans_tp8_engines_and_a_sync_under_10_s(capsys):
    """Issue 48's goal: ppo_70b with vLLM gets an engine of TP8 over each node's 8 GPUs (4 per actor replica, 16 in
    all) and, over CUDA IPC, a planned sync of at most 10 s a step; the engine fits beside the colocated roles.
    The file transport on /dev/shm is refused (each replica spans 4 nodes); ipc is the default."""
    rc, d = _plan(capsys, "--config", "ppo_70b", "rollout.name=vllm", "rollout.vllm.weight_transport=ipc")
    v = d["vllm"]
    assert rc == 0 and d["fits"] and not v["problems"]
    assert v["engines"] == 16 and v["engine_tp"] == [8] and v["engine_gpus"] == [8] and v["engines_per_replica"] == 4
    assert v["total"] == pytest.approx(sum(v["terms"].values())) and v["total"] <= 10.0
    assert v["model_bytes"] == 70_553_706_496 * 2
    assert v["memory"]["generation"] <= v["memory"]["usable"]
    rc, d = _plan(capsys, "--config", "ppo_70b", "rollout.name=vllm", "rollout.vllm.weight_transport=file")
    assert rc == 1 and any("needs a shared rollout.vllm.weights_dir" in p for p in d["problems"])
    from megatron_ppo.plan.cli import main

    main(["--config", "ppo_70b", "rollout.name=vllm", "rollout.vllm.weight_transport=ipc"])
    out = capsys.readouterr().out
    assert "vLLM engines: 16 of TP8 x PP1 (8 GPUs each, on one node), 4 per actor replica" in out
    assert f"total  {v['total']:7.2f} s per step" in out


def test_engine_memory_by_hand(capsys):
    """An engine GPU while generating: the model / (TP x PP) + K and V of its sequences (KV groups split by TP,
    layers by PP). gsm8k_7b's colocated roles leave 3.6 of 74 GiB, less than a TP4 engine's 3.5 GiB weights and
    its context: the plan says so and exits 1."""
    from megatron_ppo.plan.memory import vllm_engine_bytes

    per_token = 2 * 4 * 1 * 16 * E  # K and V x 4 layers x ceil(2 groups / TP2) x head dim 16
    assert vllm_engine_bytes(SMALL, 2, 1, 100, 3, E) == {"weights": B // 2, "kv_cache": per_token * 100 * 3,
                                                         "kv_cache_min": per_token * 100}
    assert vllm_engine_bytes(SMALL, 1, 2, 100, 3, E)["kv_cache"] == 2 * 2 * 2 * 16 * E * 100 * 3  # 2 layers, 2 groups
    rc, d = _plan(capsys, "--config", "gsm8k_7b", "rollout.name=vllm", "rollout.vllm.weight_transport=ipc")
    m = d["vllm"]["memory"]
    assert d["vllm"]["engine_tp"] == [4] and d["vllm"]["engines"] == 2
    assert m["generation"] == m["roles"] + m["engine_weights"] + m["engine_kv_cache"] + m["engine_context"]
    assert m["engine_weights"] == 7_615_616_512 * 2 // 4
    assert rc == 1 and any(p.startswith("vllm: vLLM engine:") for p in d["problems"])


def test_an_engine_that_does_not_match_the_replica_is_a_problem(capsys):
    """rollout.vllm TP x PP other than the replica's GPUs on a node: the plan names the numbers and exits 1."""
    rc, d = _plan(capsys, "--config", "ppo_70b", "rollout.name=vllm", "rollout.vllm.weight_transport=ipc",
                  "rollout.vllm.tensor_model_parallel_size=4")
    assert rc == 1 and "4 x pipeline_model_parallel_size 1 = 4 GPUs, but actor replica 0 holds 8" in d["vllm"]["error"]
    assert any("holds 8 GPUs on node 0" in p for p in d["problems"])
