"""The planner on paper (issue 27): `megatron-ppo plan`'s memory columns against Megatron-LM's own theoretical
memory formula for the same layouts, and its step-time model (compute + communication) against published RL
step times of NeMo-RL and verl. Writes the section between BEGIN and END of docs/bench/scaling.md (the rest of
the page is kept; without the markers the section is appended), then run tools/collect_benchmarks.py.

    .venv/bin/python tools/bench_plan_vs_published.py [--page docs/bench/scaling.md] [--check]

Nothing here is measured: the published numbers are quoted with their source and setup, the rest is the planner's
arithmetic (megatron_ppo/plan/) and megatron_ppo/plan/megatron_reference.py. --check exits 1 when the page's section
is not what this tool writes (tests/unit/test_plan_vs_published.py runs it).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ppo.models.arch import ModelArch  # noqa: E402
from megatron_ppo.plan import megatron_reference as M  # noqa: E402
from megatron_ppo.plan.memory import GIB, Hardware, Layout, Workload, memory, total_params  # noqa: E402

PAGE = REPO / "docs" / "bench" / "scaling.md"
BEGIN = "<!-- plan-vs-published: written by tools/bench_plan_vs_published.py; edit the tool, not this section -->"
END = "<!-- /plan-vs-published -->"
COMMAND = "Command: `.venv/bin/python tools/bench_plan_vs_published.py` (then `python tools/collect_benchmarks.py`)"

# ------------------------------------------------------------------------------------------------ architectures
LLAMA3_70B = ModelArch(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, rotary_base=500000.0,
                       norm_epsilon=1e-5)
# meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256
LLAMA31_8B = ModelArch(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, rotary_base=500000.0,
                       norm_epsilon=1e-5)
# Qwen/Qwen3-32B config.json: 64 layers, hidden 5120, intermediate 25600, 64 heads of head_dim 128 (q = 8192 wide, not
# hidden), 8 KV heads, vocab 151936, untied. Its QK-norm (2 x 128 weights a layer) is not in ModelArch.
QWEN3_32B = ModelArch(num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                      num_query_groups=8, vocab_size=151936, max_position_embeddings=40960, rotary_base=1000000.0,
                      kv_channels=128)


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    name: str
    arch: ModelArch
    layout: Layout
    seq: int
    micro: int
    micro_batches: int  # per optimizer step on one DP rank (the 1F1B in-flight bound)
    why: str


MEMORY_CASES = [
    MemoryCase("configs/ppo_70b.yaml actor (Llama-3-70B)", LLAMA3_70B, Layout(8, 4, 4, True, True, "full"),
               1024, 8, 4, "the configured layout"),
    MemoryCase("configs/ppo_70b.yaml actor, selective", LLAMA3_70B, Layout(8, 4, 4, True, True, "selective"),
               1024, 8, 4, "the same with selective recompute: Megatron's SP formula applies"),
    MemoryCase("Llama-3.1-8B", LLAMA31_8B, Layout(2, 1, 4, True, True, "selective"), 4096, 1, 8, "TP2 PP1"),
    MemoryCase("Qwen3-32B", QWEN3_32B, Layout(8, 2, 2, True, True, "selective"), 4096, 1, 8, "TP8 PP2"),
    MemoryCase("Llama-3.1-8B, NeMo-RL's layout", LLAMA31_8B, Layout(1, 2, 8, False, True, "full"), 4096, 1, 64,
               "grpo-llama3.1-8b-instruct-2n8g: TP1 PP2, activation checkpointing"),
    MemoryCase("Qwen3-32B, NeMo-RL's layout", QWEN3_32B, Layout(4, 4, 2, True, True, "none"), 4096, 1, 256,
               "grpo-qwen3-32b-4n8g: TP4 PP4 SP, no recompute"),
]


def memory_rows() -> list[dict]:
    rows = []
    for c in MEMORY_CASES:
        work = Workload(seq_len=c.seq, micro_batch=c.micro, micro_batches=c.micro_batches)
        mem = memory(c.arch, "actor", c.layout, work)
        rep = M.report_theoretical_memory(M.megatron_args(c.arch, c.layout, c.seq, c.micro), c.micro_batches)
        in_flight = min(c.layout.pp, c.micro_batches)
        explained = None
        if rep["branch"] == "sp+selective":
            explained = mem.activations + M.documented_activation_delta(c.arch, c.seq, c.micro, c.layout, in_flight)
        rows.append({"case": c, "mem": mem, "megatron": rep, "explained": explained})
    return rows


# ------------------------------------------------------------------------------------------------ published
NEMO_RL_SOURCE = ("NeMo-RL v0.5 performance summary, \"H100 BF16 Benchmarks\" (DGX-H100, training and generation "
                  "BF16, Megatron-core training, vLLM generation, GRPO on OpenMathInstruct-2): "
                  "https://github.com/NVIDIA-NeMo/RL/blob/v0.5.0/docs/about/performance-summary.md (tag v0.5.0 = "
                  "6c7089300fded94abfa49bb9cbf9eb357d862461; also https://docs.nvidia.com/nemo/rl/0.5.0/about/"
                  "performance-summary.html); recipes examples/configs/recipes/llm/performance/*.yaml over "
                  "examples/configs/grpo_math_1B.yaml at the same tag")
VERL_SOURCE = ("verl \"Training DeepSeek 671b\" page, section \"Qwen3-30B-A3B MOE\": "
               "https://verl.readthedocs.io/en/latest/perf/dpsk.html, whose source is "
               "https://github.com/volcengine/verl/blob/b178a3cd56f58b2d502255daba591e92833930a7/docs/perf/dpsk.md "
               "(the table dates from 4c7812c40b473867b4ba1d6d5e8687841578aa66); the script it points to: "
               "https://github.com/volcengine/verl/blob/b178a3cd56f58b2d502255daba591e92833930a7/examples/"
               "grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh")

# Each: what NeMo-RL's table says (quoted), the recipe's setup, and the overrides that make configs/ppo_70b.yaml the
# closest run our planner can describe. ``prompt``: our assumption (the table gives only the average total length).
NEMO_RL = [
    {"model": "Llama-3.1-8B-Instruct", "arch": LLAMA31_8B, "gpus": 16, "t_max": 4096, "g_avg": 1019,
     "g_gbs": 2048, "t_gbs": 512, "gen": "[1,1]", "train": "[1,1,1,1,1,2,n/a] (as printed)",
     "tokens_per_s_gpu": 1581, "step_s": 92.8,
     "recipe": "grpo-llama3.1-8b-instruct-2n8g.yaml: 64 prompts x 32 generations, train_global_batch_size 512, "
               "micro-batch 1 with sequence packing (4096 tokens), pipeline_model_parallel_size 2, "
               "activation_checkpointing, distributed optimizer with overlap_grad_reduce, vLLM TP1, KL penalty "
               "0.01 against the reference (its log-probs are computed)",
     "overrides": ["algorithm.adv_estimator=grpo", "cluster.nnodes=2", "actor.model.arch.num_layers=32",
                   "actor.model.arch.hidden_size=4096", "actor.model.arch.ffn_hidden_size=14336",
                   "actor.model.arch.num_attention_heads=32", "actor.model.arch.num_query_groups=8",
                   "data.train_batch_size=64", "rollout.n=32", "actor.ppo_mini_batch_size=16",
                   "actor.ppo_max_token_len_per_gpu=4096", "ref.log_prob_max_token_len_per_gpu=8192",
                   *(f"cluster.{r}.{k}" for r in ("actor", "critic", "ref") for k in (
                       "tensor_model_parallel_size=1", "pipeline_model_parallel_size=2", "sequence_parallel=false"))],
     "arch_in_python": False},
    {"model": "Qwen3-32B", "arch": QWEN3_32B, "gpus": 32, "t_max": 4096, "g_avg": 3251, "g_gbs": 2048,
     "t_gbs": 512, "gen": "[4,1]", "train": "[4,1,1,4,n/a]", "tokens_per_s_gpu": 571, "step_s": 376,
     "recipe": "grpo-qwen3-32b-4n8g.yaml: 64 prompts x 32 generations, train_global_batch_size 512, micro-batch 1 "
               "with sequence packing (4096 tokens), TP4 PP4 with sequence parallelism, no activation "
               "checkpointing, vLLM TP4, the same KL penalty",
     "overrides": ["algorithm.adv_estimator=grpo", "cluster.nnodes=4", "actor.model.arch.num_layers=64",
                   "actor.model.arch.hidden_size=5120", "actor.model.arch.ffn_hidden_size=25600",
                   "actor.model.arch.num_attention_heads=64", "actor.model.arch.num_query_groups=8",
                   "actor.model.arch.vocab_size=151936", "actor.model.arch.rotary_base=1000000.0",
                   "actor.model.recompute_granularity=null", "actor.model.recompute_method=null",
                   "actor.model.recompute_num_layers=null", "data.train_batch_size=64", "rollout.n=32",
                   "actor.ppo_mini_batch_size=16", "actor.ppo_max_token_len_per_gpu=4096",
                   "ref.log_prob_max_token_len_per_gpu=16384",
                   *(f"cluster.{r}.{k}" for r in ("actor", "critic", "ref") for k in (
                       "tensor_model_parallel_size=4", "pipeline_model_parallel_size=4"))],
     "arch_in_python": True},
]
NEMO_RL_NOT_MODELLED = {"model": "Qwen3-30B-A3B (MoE)", "gpus": 32, "t_max": 4096, "g_avg": 3196, "g_gbs": 2048,
                        "t_gbs": 512, "gen": "[2,1]", "train": "[1,1,8,1,n/a]", "tokens_per_s_gpu": 1066,
                        "step_s": 198}
VERL_MFU = [(8, 1, 0.40), (16, 2, 0.37), (32, 4, 0.31)]  # (GPUs, nodes, MFU); TP1 PP1 EP8, optimizer offload 1.0
PROMPT = 256  # our assumption: OpenMathInstruct-2 prompt tokens (NeMo-RL publishes only the average total length)


def planner_run(peer: dict, total_len: int) -> dict:
    """The planner on configs/ppo_70b.yaml + the peer's overrides at ``total_len`` tokens per sequence."""
    from megatron_ppo.config import load_config
    from megatron_ppo.plan.layouts import colocated, comm_times, role_specs, step_time, with_world

    overrides = peer["overrides"] + [f"data.max_prompt_length={PROMPT}",
                                     f"data.max_response_length={total_len - PROMPT}"]
    cfg = load_config("ppo_70b", overrides)
    gpus, per_node = peer["gpus"], cfg.cluster.n_gpus_per_node
    specs = with_world(role_specs(cfg, gpus), gpus)
    if peer["arch_in_python"]:  # head_dim != hidden / heads: not expressible in an inline arch override
        specs = {r: dataclasses.replace(s, arch=peer["arch"]) for r, s in specs.items()}
    shape = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size",
             "head_dim", "tie_word_embeddings")
    assert all(getattr(specs["actor"].arch, k) == getattr(peer["arch"], k) for k in shape), specs["actor"].arch
    hw = Hardware()
    times = step_time(specs, gpus, hw, per_node)
    _, colo, problems = colocated(specs, hw, per_node)
    return {"overrides": overrides, "specs": specs, "times": times, "comm": comm_times(specs, hw, per_node),
            "colocated_gib": colo / GIB, "fits": not problems, "gpus": gpus}


# ------------------------------------------------------------------------------------------------ the section
def _g(x: float) -> str:
    return f"{x / GIB:.2f}"


def layer_ratio(arch: ModelArch) -> float:
    """Megatron's SP per-layer activation bytes over the planner's (bf16): (18h + 4f) / (12h + 4h g/a + 6f)."""
    h, f, g, a = arch.hidden_size, arch.ffn_hidden_size, arch.num_query_groups, arch.num_attention_heads
    return (18 * h + 4 * f) / (12 * h + 4 * h * g / a + 6 * f)


def memory_note(r: dict) -> str:
    c, mem, rep = r["case"], r["mem"], r["megatron"]
    if r["explained"] is not None:
        return f"per layer Megatron/ours {layer_ratio(c.arch):.3f}" + (
            "; Megatron's total includes the output layer (PP = 1)" if c.layout.pp == 1 else "")
    x = rep["activation"] / mem.activations
    if c.layout.recompute == "full":
        return f"Megatron's formula has no full recompute: {x:.1f} x ours"
    if c.layout.sp:
        return (f"SP without selective recompute: Megatron's no-SP branch leaves its 10sbh per layer undivided by "
                f"TP and assumes f = 4h ({x:.2f} x ours)")
    return f"{x:.2f} x"


def memory_section() -> list[str]:
    rows = memory_rows()
    out = ["### Memory: the planner against Megatron-LM's theoretical memory formula", "",
           f"Megatron-LM's `report_theoretical_memory` ({M.SOURCE}; its dense path rewritten in "
           "`megatron_ppo/plan/megatron_reference.py`, which tests/unit/test_plan_megatron_formula.py holds to the "
           "planner) next to the planner's actor columns for the same layout and micro-batch, GiB per GPU at the "
           "most loaded pipeline stage; bf16, distributed optimizer, flash attention.", "",
           "| model, layout | tokens (s x b, m) | weights + grads + optimizer: Megatron / ours | (ours - Megatron) / Megatron | activations: "
           "Megatron (its branch) / ours | ours + the documented terms | ours: logits | note |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c, mem, rep = r["case"], r["mem"], r["megatron"]
        explained = (f"{_g(r['explained'])} (= Megatron)" if abs(r["explained"] - rep["activation"])
                     <= 1e-6 * rep["activation"] else _g(r["explained"])) if r["explained"] is not None else "-"
        out.append(f"| {c.name}: {c.layout.label()} | {c.seq} x {c.micro}, m={c.micro_batches} | "
                   f"{_g(rep['weight_and_optimizer'])} / {_g(mem.resident)} | "
                   f"{(mem.resident - rep['weight_and_optimizer']) / rep['weight_and_optimizer']:+.1e} | {_g(rep['activation'])} ({rep['branch']}) / "
                   f"{_g(mem.activations)} | {explained} | {_g(mem.logits)} | {memory_note(r)} |")
    worst = max(abs(r["mem"].resident - r["megatron"]["weight_and_optimizer"]) / r["megatron"]["weight_and_optimizer"]
                for r in rows)
    out += ["", "Where they agree and where they differ, term by term:", "",
            "- **Weights, gradients, optimizer: the same model** (worst difference "
            f"{worst:.1e} of the total). Both count bf16 weights + fp32 gradients + fp32 master weights and Adam "
            "moments, 6 + 12/DP bytes per parameter with the distributed optimizer (18 without), on the most loaded "
            "stage, with Megatron's vocabulary padding. The rest is the final norm: Megatron spreads it as "
            "`final_layernorm / PP` over every stage, the planner puts it on the last stage with the LM head.",
            "- **Activations with sequence parallelism and selective recompute** (Megatron's `compute_activation_"
            "memory`, Korthikanti et al. 2022 Table 2, `sbh(18 + 4f/h)/t` per layer): the planner's Llama layer "
            "(`2sb(4h + 2h + 2h g/a + 3f)/t`) plus three documented terms is Megatron's number to the byte (column "
            "6): Megatron's GPT layer keeps two 1-byte dropout masks (+2sbh), full-width K and V (+4sbh(1 - g/a); "
            "GQA keeps g/a of them) and a GeLU MLP's two f-wide tensors where SwiGLU keeps three (-2sbf); plus the "
            "embedding's input ids and dropout mask and, at PP = 1, the output layer's input and fp32 logits "
            "(`4sb(h + V)/t`). The planner shows the logits in its own column instead, at every PP (the last "
            "stage's, added to the first stage's activations: conservative): `sbV/t x (2 + 4)` bytes, the bf16 "
            "logits and an fp32 log-softmax copy. Per layer the planner is above Megatron by "
            + ", ".join(f"{1 / layer_ratio(a) - 1:.1%} ({n})" for n, a in (("Llama-3-70B", LLAMA3_70B),
                                                                          ("Llama-3.1-8B", LLAMA31_8B),
                                                                          ("Qwen3-32B", QWEN3_32B)))
            + " (the SwiGLU tensor outweighs the masks and the K/V saving; most for Qwen3's f = 5h).",
            "- **Every other layout** goes to Megatron's `compute_activation_memory_without_sp`: per layer "
            "`sbh(10 + 24/t)` (the paper's TP-without-SP row, which hard-codes f = 4h), x 1.05 for temporaries, "
            "chosen whenever recompute is not selective, with or without SP. It has no full-recompute case: for "
            "ppo_70b's configured `rc=full` it reports the activations of a run that keeps every layer's, against the "
            "planner's layer inputs + one layer. The planner's numbers for these rows follow the layout (full "
            "recompute, SP); Megatron's do not, so no tolerance is claimed there, only the reasons (note column).",
            "- Not in either: CUDA context, NCCL buffers, allocator fragmentation (the planner's `--headroom-gib`, "
            "6 GiB); Megatron's formula has no KV cache (generation) and no critic.", ""]
    return out


def published_section() -> list[str]:
    out = ["### Step time: the planner against published RL step times", "",
           "Published (quoted, not measured here):", "",
           f"- {NEMO_RL_SOURCE}.",
           f"- {VERL_SOURCE}.", "",
           "| source | model | GPUs | algorithm | T-max seq / G-average seq | G-GBS / T-GBS | generation [TP,PP] | "
           "training [TP,CP,EP,PP,VPP] | tokens/s/GPU | s/step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in NEMO_RL + [NEMO_RL_NOT_MODELLED]:
        out.append(f"| NeMo-RL v0.5 | {p['model']} | {p['gpus']} | GRPO on-policy | {p['t_max']:,} / {p['g_avg']:,} | "
                   f"{p['g_gbs']:,} / {p['t_gbs']} | {p['gen']} | {p['train']} | {p['tokens_per_s_gpu']:,} | "
                   f"{p['step_s']:g} |")
    out += ["", "NeMo-RL defines the step time as training + generation + policy log-probs + refit (weights to "
            "vLLM), and tokens/s/GPU as the step's tokens / (step time x GPUs), averaged over 5 steps. Its recipes "
            "(v0.5.0):", ""]
    out += [f"- {p['model']}: {p['recipe']}." for p in NEMO_RL]
    out += ["", "verl, Qwen3-30B-A3B (MoE, 3B active of 30B), Megatron backend, training MFU as the page lists it "
            "(TP1 PP1 EP8, OFFLOAD_FRACTION 1, OFFLOAD_OPTIM True): "
            + ", ".join(f"{g} GPUs ({n} node{'s' if n > 1 else ''}) {mfu:.2f}" for g, n, mfu in VERL_MFU)
            + ". The table names no GPU; its script says \"tested in NNODES=1~4 * 96G H20 GPU\" (H20s, not "
            "H100s), DAPO-style GRPO, 512 prompts x 16 responses, prompts up to 2,048 and "
            "responses up to 8,192 tokens, mini-batches of 128 prompts, dynamic batch size, vLLM TP4. No step time "
            "or tokens/s is given for it.", ""]
    runs = [(p, kind, planner_run(p, n)) for p in NEMO_RL
            for kind, n in (("max", p["t_max"]), ("average", p["g_avg"]))]
    out += ["Our planner on the closest configuration it can describe: configs/ppo_70b.yaml (H100 80 GB, 8 per "
            "node, bf16, distributed optimizer, `rollout.name=megatron`) with the overrides below, default hardware "
            "(MFU 0.40 of 989 TFLOP/s, 3.35 TB/s HBM, NVLink 450 GB/s, 50 GB/s per GPU between nodes, no DP "
            f"overlap), prompts of {PROMPT} tokens (our assumption: the page gives only the average total length), "
            "all sequences at the maximum (the planner's design: max lengths) and, second row, all at NeMo-RL's "
            "average. Seconds per step:", "",
            "| model | lengths (prompt + response) | generate | old log-prob | ref log-prob | actor update | "
            "comm (TP / PP / DP) | step s | tokens/s/GPU | published s/step, tokens/s/GPU | predicted / published: "
            "s/step, tokens/s/GPU | colocated GiB/GPU (fits 74?) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p, kind, r in runs:
        t, c = r["times"], r["comm"]
        tp, pp, dp = (sum(x[k] for x in c.values()) for k in ("tp", "pp", "dp"))
        n = p["t_max"] if kind == "max" else p["g_avg"]
        per_gpu = t["tokens_per_s"] / r["gpus"]
        out.append(f"| {p['model']} | {kind}: {PROMPT} + {n - PROMPT} | {t['generate']:.1f} | "
                   f"{t['old_log_prob']:.1f} | {t['ref_log_prob']:.1f} | {t['actor_update']:.1f} | "
                   f"{t['comm']:.1f} ({tp:.1f} / {pp:.1f} / {dp:.1f}) | {t['step']:.1f} | {per_gpu:,.0f} | "
                   f"{p['step_s']:g}, {p['tokens_per_s_gpu']:,} | {t['step'] / p['step_s']:.2f}x, "
                   f"{per_gpu / p['tokens_per_s_gpu']:.2f}x | {r['colocated_gib']:.1f} "
                   f"({'yes' if r['fits'] else 'no'}) |")
    out += ["", "Reproduce a row: `megatron-ppo plan --config ppo_70b --gpus <GPUs> <overrides> "
            "data.max_prompt_length=256 data.max_response_length=<response>`, overrides:", ""]
    for p in NEMO_RL:
        extra = (" (plus head_dim 128, which an inline arch cannot set: ArchConfig has no kv_channels and the HF "
                 "converter does not read Qwen3 configs, so the tool sets the ModelArch in Python; the CLI with "
                 f"these overrides plans a {total_params(p['arch'].replace(kv_channels=None)) / 1e9:.1f}B model with "
                 f"{p['arch'].hidden_size // p['arch'].num_attention_heads}-wide heads)") if p["arch_in_python"] else ""
        out.append(f"- {p['model']}, {p['gpus']} GPUs: `{' '.join(p['overrides'])}`{extra}")
    run = {(p["model"], k): r for p, k, r in runs}
    ratio = {key: r["times"]["step"] / next(p for p in NEMO_RL if p["model"] == key[0])["step_s"]
             for key, r in run.items()}
    llama, qwen = NEMO_RL[0]["model"], NEMO_RL[1]["model"]
    implied = {p["model"]: p["g_gbs"] * p["g_avg"] / (p["step_s"] * p["gpus"]) for p in NEMO_RL}
    fits = [f"{m} at the {k}" for (m, k), r in run.items() if r["fits"]]
    share = {m: run[(m, "average")]["times"]["comm"] / run[(m, "average")]["times"]["step"] for m in (llama, qwen)}
    gen_share = {m: run[(m, "average")]["times"]["generate"] / run[(m, "average")]["times"]["step"]
                 for m in (llama, qwen)}
    max_gen_share = max(r["times"]["generate"] / r["times"]["step"] for (m, k), r in run.items() if k == "max")
    top = {m: max(("tp", "pp", "dp"), key=lambda k: sum(c[k] for c in run[(m, "average")]["comm"].values()))
           for m in (llama, qwen)}
    out += ["", "Where our model and theirs differ, and by how much:", "",
            f"- **Lengths.** The planner puts every sequence at one length. NeMo-RL's 2,048 sequences average "
            f"1,019 (Llama) and 3,251 (Qwen3-32B) tokens of at most 4,096. At the maximum the planner predicts "
            f"{ratio[(llama, 'max')]:.2f}x (Llama) and {ratio[(qwen, 'max')]:.2f}x (Qwen3) the published step "
            f"time; at the average {ratio[(llama, 'average')]:.2f}x and {ratio[(qwen, 'average')]:.2f}x. Training "
            "and log-prob phases scale with the tokens (the average is right for them, with packing); an on-policy "
            "generation lasts until its longest response, so the truth for `generate` lies between the two rows. "
            f"The max-length rows' tokens/s/GPU count 4,096 tokens per sequence, {4096 / NEMO_RL[0]['g_avg']:.1f}x "
            f"and {4096 / NEMO_RL[1]['g_avg']:.1f}x NeMo-RL's, so only the average rows' tokens/s/GPU compare like "
            "with like.",
            "- **Published tokens/s/GPU vs its own definition.** 2,048 x the average length / (step time x GPUs) "
            f"gives {implied[llama]:,.0f} (Llama) and {implied[qwen]:,.0f} (Qwen3-32B) from the table's own "
            "numbers, against the published 1,581 and 571; the page notes that its columns are 5-step averages and "
            "do not match the formula exactly.",
            f"- **Generation** is {gen_share[llama]:.0%} of the Llama step and {gen_share[qwen]:.0%} of the Qwen3 "
            f"step at the average length (up to {max_gen_share:.0%} at the maximum). The planner's is the Megatron engine's "
            "at the training layout: "
            "a DP replica decodes its whole share at once, every step reading its weights and the full-length KV "
            "cache from HBM, the stages one after the other. NeMo-RL generates with vLLM (paged KV cache, continuous "
            "batching, CUDA graphs) at its own layout (Llama: 16 TP1 engines where the planner has 8 PP2 replicas; "
            "Qwen3: 8 TP4 engines where it has 2 TP4 PP4 replicas) in 60 % of the GPU memory "
            "(gpu_memory_utilization 0.6), so it cannot hold the planner's per-replica KV cache at once either. The "
            "planner's colocated memory (last column), dominated by that cache, fits 74 GiB only for "
            + (", ".join(fits) if fits else "no row") + ".",
            "- **Algorithm.** Both are GRPO with a reference KL term: the planner's step has old log-prob, "
            "reference log-prob, actor update and generation, no critic (`algorithm.adv_estimator=grpo` "
            "disables it; a PPO step would add the critic's values and update at the actor's cost, "
            f"+{critic_share(run[(llama, 'average')]):.0%} on the Llama row at the average length). NeMo-RL's step "
            "also includes refit (weights into vLLM) and the reward; the planner has neither (`rollout.name="
            "megatron`: nothing to copy).",
            "- **Compute rate.** The planner assumes MFU 0.40 on every forward/backward phase; NeMo-RL's page "
            "gives no MFU for these rows. verl's measured training MFU for a MoE model falls from 0.40 (8 GPUs) "
            "to 0.31 (32 GPUs) on H20s: a constant MFU cannot show that; the planner's comm terms are the part of "
            f"such a fall it can show (here communication is {share[llama]:.1%} (Llama, mostly {top[llama].upper()}) "
            f"and {share[qwen]:.1%} (Qwen3, mostly {top[qwen].upper()}) of the step at the average length).",
            "- **Communication** (plan/comm.py): bandwidth only, at peak link rates, TP and PP not overlapped and "
            "DP not overlapped (this driver; NeMo-RL overlaps the gradient reduction, `--dp-overlap` models it). "
            "Latency is not modelled, which undercounts decode's small per-token TP messages.",
            "- **MoE** (Qwen3-30B-A3B at NeMo-RL, verl's MFU rows): not modelled. The planner has no experts, "
            "expert parallelism or all-to-all, and would count FLOPs from all 30B parameters instead of the 3B "
            "active ones; no prediction is given rather than a wrong one.", ""]
    return out


def critic_share(run: dict) -> float:
    """How much longer the step would be with PPO's critic (values + update) at the actor's layout: the same
    forward and update FLOPs as the actor (a value head instead of the LM head is within 2 %)."""
    t = run["times"]
    extra = t["old_log_prob"] + t["actor_update"] + t["old_log_prob_comm"] + t["actor_update_comm"]
    return extra / t["step"]


def section() -> str:
    lines = [BEGIN, "", "## The planner on paper: Megatron-LM's memory formula and published step times (issue 27)",
             "", COMMAND, "", "Nothing in this section is measured: the planner's arithmetic next to Megatron-LM's "
             "formula and numbers published by NeMo-RL and verl, each with its source. "
             f"Parameters: Llama-3-70B {total_params(LLAMA3_70B) / 1e9:.2f}B, Llama-3.1-8B "
             f"{total_params(LLAMA31_8B) / 1e9:.2f}B, Qwen3-32B {total_params(QWEN3_32B) / 1e9:.2f}B (without its "
             "QK-norm weights).", "", *memory_section(), *published_section(), END]
    return "\n".join(lines) + "\n"


def render_page(text: str) -> str:
    """``text`` (the page) with the section replaced, or appended when the page has no markers."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        return head + section().rstrip("\n") + tail
    return text.rstrip("\n") + "\n\n" + section()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--check", action="store_true", help="exit 1 if the page's section is not what this tool writes")
    args = p.parse_args(argv)
    old = args.page.read_text() if args.page.exists() else ""
    new = render_page(old)
    if args.check:
        if new != old:
            print(f"{args.page}: the plan-vs-published section is stale; run tools/bench_plan_vs_published.py")
            return 1
        print(f"{args.page}: up to date")
        return 0
    args.page.write_text(new)
    print(f"written: {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
