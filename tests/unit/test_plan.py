"""The planner's formulas against hand numbers, real Megatron models and the shipped configs."""
from __future__ import annotations

import json

import pytest

from megatron_ppo.models.arch import ModelArch, tiny_arch
from megatron_ppo.plan import Layout, Workload, layer_params, memory, stage_params, total_params
from megatron_ppo.plan.memory import layer_activation_bytes

LLAMA2_7B = ModelArch(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                      num_query_groups=32, vocab_size=32000, max_position_embeddings=4096)
LLAMA3_70B = ModelArch(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=8192)
QWEN25_7B = ModelArch(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                      num_query_groups=4, vocab_size=152064, max_position_embeddings=32768, add_qkv_bias=True)


@pytest.mark.parametrize("arch, expected", [
    (LLAMA2_7B, 6_738_415_616),    # Llama-2-7B's published count
    (LLAMA3_70B, 70_553_706_496),  # Llama-3-70B: "70.6B"
    (QWEN25_7B, 7_615_616_512),    # Qwen2.5-7B: "7.61B"
])
def test_total_params_match_the_model_cards(arch, expected):
    assert total_params(arch) == expected
    # the critic swaps the LM head (vocab x hidden) for a one-row value head
    assert total_params(arch, "critic") == expected - arch.vocab_size * arch.hidden_size + arch.hidden_size


def test_llama2_7b_layer_by_hand():
    # 4 h^2 attention (MHA) + 3 h f SwiGLU + 2 h norms
    assert layer_params(LLAMA2_7B) == 4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096
    # TP8: linears / 8, norms replicated
    assert layer_params(LLAMA2_7B, 8) == (4 * 4096 ** 2 + 3 * 4096 * 11008) // 8 + 2 * 4096


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2), (8, 4)])
@pytest.mark.parametrize("tied", [False, True])
def test_stage_params_add_up_over_ranks(tp, pp, tied):
    """Sharded parts summed over the TP x PP ranks, the replicated norms counted once per TP rank, and the vocab
    padding and the tied copy on the last stage: back to the total."""
    arch = tiny_arch(num_layers=8, hidden_size=64, num_attention_heads=8, num_query_groups=8, vocab_size=1000,
                     tie_word_embeddings=tied)
    stages = [stage_params(arch, "actor", tp, pp, s) for s in range(pp)]
    pad = (arch.padded_vocab_size(tp) - arch.vocab_size) * arch.hidden_size
    copies = 2 if (not tied or pp > 1) else 1
    norms = (2 * arch.num_layers + 1) * arch.hidden_size
    summed = sum(s.total for s in stages) * tp - norms * (tp - 1)
    assert summed == total_params(arch) + copies * pad + (arch.vocab_size * arch.hidden_size if tied and pp > 1
                                                          else 0)


def test_bytes_per_parameter_follow_megatrons_table():
    """Megatron-LM distributed-optimizer guide: bf16 params + fp32 grads: 18 bytes/param, 6 + 12/DP distributed; fp32
    params: 16, 8 + 8/DP."""
    arch, work = LLAMA2_7B, Workload(seq_len=16, micro_batch=1)
    n = stage_params(arch, "actor").total
    for dp in (1, 4, 8):
        rep = memory(arch, "actor", Layout(dp=dp, distributed_optimizer=False), work)
        dist = memory(arch, "actor", Layout(dp=dp, distributed_optimizer=True), work)
        assert rep.resident == 18 * n
        assert dist.resident == 6 * n + -(-12 * n // dp)
        f32 = memory(arch, "actor", Layout(dp=dp), Workload(seq_len=16, micro_batch=1, param_bytes=4))
        assert f32.resident == 8 * n + -(-8 * n // dp)
    ref = memory(arch, "ref", Layout(dp=4), work)
    assert (ref.grads, ref.optimizer, ref.weights) == (0, 0, 2 * n)
    off = memory(arch, "actor", Layout(dp=4, offload="optimizer"), work)
    assert off.optimizer == 0 and off.optimizer_distributed == -(-12 * n // 4)


def test_activations_korthikanti_by_hand():
    """GPT-3 style numbers in the paper's terms: MHA, f = 4h, no flash: s b h (8 + 32/t) bytes of tensors + the
    5 a s^2 b / t of scores in the paper become 2 a s^2 b / t here (bf16 scores, no dropout mask/softmax copy)."""
    arch = ModelArch(num_layers=1, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                     num_query_groups=16, vocab_size=128, max_position_embeddings=4096)
    s, b, h, a = 2048, 2, 1024, 16
    for tp, sp in ((1, False), (4, False), (4, True)):
        got = layer_activation_bytes(arch, s, b, tp, sp, 2, "none", flash=False)
        repl = 8 * s * b * h / (tp if sp else 1)
        shard = 2 * s * b * (2 * h + 2 * h + 3 * 4 * h) / tp
        assert got == int(repl + shard + 2 * a * s * s * b / tp)
        assert layer_activation_bytes(arch, s, b, tp, sp, 2, "selective", flash=False) == int(repl + shard)
    # full recompute keeps the layer inputs (+ one layer for the recomputation)
    full = memory(arch.replace(num_layers=4), "actor", Layout(recompute="full"), Workload(seq_len=s, micro_batch=b))
    assert full.activations == 4 * s * b * h * 2 + layer_activation_bytes(arch, s, b, 1, False, 2, "none", True)


def test_megatron_model_has_the_planned_parameters(megatron_single):
    """A real GPTModel (TP1) per role and arch variant counts exactly what stage_params says."""
    from megatron_ppo.models.gpt import build_gpt_model

    for arch in (tiny_arch(), tiny_arch(tie_word_embeddings=True), tiny_arch(add_qkv_bias=True, vocab_size=500)):
        for role, build_role in (("actor", "actor"), ("critic", "critic"), ("ref", "ref")):
            model = build_gpt_model(arch, role=build_role)
            assert sum(p.numel() for p in model.parameters()) == stage_params(arch, role).total, (arch, role)


def _plan(capsys, *args):
    from megatron_ppo.plan.cli import main

    rc = main(list(args))
    return rc, capsys.readouterr().out


def test_plan_70b_config_fits_at_the_recommended_pp(capsys):
    rc, out = _plan(capsys, "--config", "ppo_70b", "--json")
    d = json.loads(out)
    assert rc == 0 and d["fits"] and d["gpus"] == 128
    assert d["params"]["actor"] == 70_553_706_496
    assert d["configured"]["actor"]["layout"].startswith("TP8 PP4 DP4 SP rc=full")
    assert d["recommended_pp"] == 4  # what configs/ppo_70b.yaml uses
    # PP=2 would fit only on paper (within the model's tolerance of the limit); PP=1 does not fit at all
    rc1, out1 = _plan(capsys, "--config", "ppo_70b", "--json", "cluster.actor.pipeline_model_parallel_size=1",
                      "cluster.critic.pipeline_model_parallel_size=1", "cluster.ref.pipeline_model_parallel_size=1")
    d1 = json.loads(out1)
    assert rc1 == 1 and not d1["fits"] and "colocated roles need" in d1["problems"][-1]


def test_colocated_roles_are_planned_as_one_process_each():
    """Each role's process keeps its own allocator's peak and its own CUDA context (issue 47): the plan is the sum of
    what every process holds, not sum(resident) + max(transient), which accepted GPUs on which the run can OOM."""
    from megatron_ppo.config import load_config
    from megatron_ppo.plan import Hardware
    from megatron_ppo.plan.layouts import colocated, released_peak, role_specs, with_world
    from megatron_ppo.plan.memory import GIB

    specs = with_world(role_specs(load_config("gsm8k_7b", []), 8), 8)
    hw = Hardware()
    rows, total, problems = colocated(specs, hw, 8)
    mems = [row.mem for row in rows.values()]
    assert not problems and total == sum(m.resident + m.transient for m in mems) + 3 * GIB  # 3 roles, 1 GiB each
    shared = released_peak(rows, hw)  # every cache given back: what the old plan counted, plus the contexts
    assert shared == sum(m.resident for m in mems) + max(m.transient for m in mems) + 3 * GIB < total
    between = Hardware(gpu_mem_gib=(shared + total) / 2 / GIB + hw.headroom_gib)  # fits only if caches came back
    assert colocated(specs, between, 8)[2][-1].startswith("colocated roles need")


def test_plan_7b_config_and_text_output(capsys):
    rc, out = _plan(capsys, "--config", "gsm8k_7b")
    assert rc == 0 and "FITS" in out and "* TP4 PP1 DP2 SP rc=selective" in out
    rc, out = _plan(capsys, "--config", "gsm8k_7b", "--gpu-mem-gib", "40")
    assert rc == 1 and "DOES NOT FIT" in out


def test_plan_flags_infeasible_layouts_with_reasons(capsys):
    rc, out = _plan(capsys, "--config", "ppo_70b", "--json")
    rows = {r["layout"]: r for r in json.loads(out)["layouts"]["actor"]}
    bad = rows["TP1 PP1 DP128 rc=none"]
    assert not bad["feasible"] and any("alone on the GPU" in p for p in bad["problems"])
    offload = rows["TP8 PP4 DP4 SP rc=full off=opt"]
    assert not offload["feasible"] and any("driver does not offload" in p for p in offload["problems"])
    assert rows["TP8 PP4 DP4 SP rc=full"]["feasible"]
