"""GPU-only model checks (skipped without CUDA): the TE spec, the SDPA spec's varlen THD path, bf16, generation.

Run on a CUDA machine with: python -m pytest -q -m gpu tests/integration/test_models_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_TOL = 3e-2


def _seqs(vocab, lens=(37, 64, 5, 100)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).cuda() for n in lens]


def _padded(seqs):
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long, device="cuda")
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        valid[i, :len(s)] = True
    return ids, valid


@pytest.mark.parametrize("strategy", ["varlen", "padded", "flex", "per_sequence", "block_mask"])
def test_sdpa_spec_packed_equals_padded_bf16(megatron_single, strategy):
    from megatron_ppo.models.attention import SDPACoreAttention, _varlen_attn
    from megatron_ppo.models.forward import model_forward, pack_sequences
    from megatron_ppo.models.gpt import build_gpt_model

    if strategy == "varlen" and _varlen_attn is None:
        pytest.skip("torch has no varlen_attn")
    arch = tiny_arch(hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512)
    model = build_gpt_model(arch, "actor", params_dtype=torch.bfloat16, transformer_impl="local")
    for m in model.modules():
        if isinstance(m, SDPACoreAttention):
            m.thd_strategy = strategy
    seqs = _seqs(arch.vocab_size)
    ids, valid = _padded(seqs)
    packed, cu = pack_sequences(seqs)
    a = model_forward(model, {"input_ids": ids})[valid].float()
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])  # padded: never math
    with fused if strategy == "padded" else nullcontext():
        b = model_forward(model, {"input_ids": packed, "cu_seqlens": cu.cuda()})[0].float()
    assert (a - b).abs().max().item() < BF16_TOL
    b.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_masked_gqa_and_padded_thd_never_take_the_math_kernel(megatron_single):
    """Issue 47: a mask with GQA (padded rows) and the padded THD strategy run with SDPA's math kernel disabled
    (it would hold fp32 [b, heads, s, s]), and give what the CPU computes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_ppo.models.attention import sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 48, 64, generator=g) for h in (8, 2, 2))
    keep = torch.ones(2, 1, 48, 48, dtype=torch.bool).tril()
    keep[1, :, :, 40:] = False  # a padded row
    want = sdpa(q, k, v, keep=keep)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = sdpa(*(x.cuda().bfloat16() for x in (q, k, v)), keep=keep.cuda())
    torch.testing.assert_close(got.float().cpu(), want, atol=BF16_TOL, rtol=0)


def test_transformer_engine_spec_matches_local_spec(megatron_single):
    from megatron_ppo.models.forward import model_forward, pack_sequences
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.spec import transformer_engine_available

    if not transformer_engine_available():
        pytest.skip("Transformer Engine not importable")
    arch = tiny_arch(hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512)
    local = build_gpt_model(arch, "actor", params_dtype=torch.bfloat16, transformer_impl="local")
    te = build_gpt_model(arch, "actor", params_dtype=torch.bfloat16, transformer_impl="transformer_engine")
    renames = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    sd = {}
    for k, v in local.state_dict().items():
        for old, new in renames.items():
            k = k.replace(old, new)
        sd[k] = v
    missing, unexpected = te.load_state_dict(sd, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    seqs = _seqs(arch.vocab_size)
    packed, cu = pack_sequences(seqs)
    batch = {"input_ids": packed, "cu_seqlens": cu.cuda()}
    a, b = model_forward(local, batch).float(), model_forward(te, batch).float()
    assert (a - b).abs().max().item() < BF16_TOL


def test_generation_on_gpu_kv_cache_equals_recompute(megatron_single):
    from megatron_ppo.rollout.generation import SamplingParams, generate
    from megatron_ppo.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_arch(), "actor", params_dtype=torch.float32)
    prompts = _seqs(500, (5, 9, 3))
    p = SamplingParams(max_response_length=16, greedy=True)
    a, b = generate(model, prompts, p), generate(model, prompts, p, use_kv_cache=False)
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-4, rtol=0)


def _decode_prompts():
    return _seqs(500, (5, 9, 3, 12, 7, 7))


def test_static_decode_graphs_equal_eager_and_follow_a_weight_update(megatron_single):
    """rollout.megatron.cuda_graphs: the graphed decode step gives the eager static step's tokens and log-probs,
    and megatron's forward's; after an optimizer step with a large learning rate the next rollout's graphs run the
    new weights (captured afresh per rollout), which a graph left on the old weights would not."""
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams, generate

    model = build_gpt_model(tiny_arch(vocab_size=500), "actor", params_dtype=torch.float32)
    params = SamplingParams(max_response_length=20, temperature=1.0, seed=3)
    greedy = SamplingParams(max_response_length=20, greedy=True)

    def three(p):
        graphs = generate(model, _decode_prompts(), p, DecodeOptions(cuda_graphs="true", alive_check_interval=2))
        eager = generate(model, _decode_prompts(), p, DecodeOptions(cuda_graphs="false", alive_check_interval=2))
        megatron = generate(model, _decode_prompts(), p, DecodeOptions(static_step=False))
        return graphs, eager, megatron

    before = three(params)
    for other in before[1:]:
        assert torch.equal(before[0].responses, other.responses)
        torch.testing.assert_close(before[0].log_probs, other.log_probs, atol=1e-4, rtol=0)
    old_greedy = generate(model, _decode_prompts(), greedy, DecodeOptions(cuda_graphs="true"))
    opt = torch.optim.SGD(model.parameters(), lr=5.0)  # in place, as megatron's optimizer writes the params
    ids = torch.cat([p[:3] for p in _decode_prompts()]).view(-1, 3)
    model(ids, None, None)[..., 7].sum().backward()
    opt.step()
    graphs, eager, megatron = three(greedy)
    assert not torch.equal(graphs.responses, old_greedy.responses)  # the update changed what greedy decodes
    assert torch.equal(graphs.responses, megatron.responses) and torch.equal(graphs.responses, eager.responses)
    torch.testing.assert_close(graphs.log_probs, megatron.log_probs, atol=1e-4, rtol=0)


def test_static_decode_loop_never_syncs_and_prefill_keeps_fused_attention(megatron_single, monkeypatch):
    """On the device: the decode loop (eager static step, every step) makes no synchronizing call
    (torch.cuda.set_sync_debug_mode('error') raises on one; the lagged alive count reads pinned memory after an
    event); bf16 GQA prefill and decode run with SDPA's math backend disabled (a masked enable_gqa call would need
    it: an fp32 [B, H, s, s] matrix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout import static_loop
    from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams, generate

    model = build_gpt_model(tiny_arch(vocab_size=500, kv_channels=64), "actor", params_dtype=torch.bfloat16)
    real = static_loop._decode_loop

    def strict(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(static_loop, "_decode_loop", strict)
    params = SamplingParams(max_response_length=24, temperature=1.0, seed=1)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        out = generate(model, _decode_prompts(), params, DecodeOptions(cuda_graphs="false"))
    assert out.responses.shape == (6, 24)


def test_cpu_gemm_routing_stays_off_on_gpu(megatron_single, monkeypatch):
    """cpu_gemm=onednn must not put its per-op Python dispatch mode on a GPU worker's passes."""
    from megatron_ppo.ops import cpu_matmul
    from megatron_ppo.rollout.generation import SamplingParams
    from megatron_ppo.rollout.megatron import MegatronEngine
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    entered = []
    real = cpu_matmul._OneDNNMatmul.__enter__
    monkeypatch.setattr(cpu_matmul._OneDNNMatmul, "__enter__", lambda self: entered.append(1) or real(self))
    worker = MegatronWorker("actor", tiny_arch(), params_dtype=torch.bfloat16, cpu_gemm="onednn")
    assert not worker.onednn
    MegatronEngine.for_worker(worker).generate(_seqs(512, (9, 5)), SamplingParams(max_response_length=4, greedy=True))
    assert entered == []


def test_actor_from_hf_weights_keeps_them_through_a_bf16_step(megatron_single, tmp_path):
    """The GPU default (model.dtype=auto: bf16): Megatron's bf16 optimizer keeps fp32 main params taken when it was
    built; the HF load after it must be reloaded into them, or the first step restores the random init (the CPU twin:
    tests/integration/test_workers_hf_weights.py)."""
    from megatron_ppo.config import load_config
    from megatron_ppo.testing.tiny_hf import TINY_VOCAB, make_tiny_hf
    from megatron_ppo.workers.actor import ActorWorker

    hf_dir = make_tiny_hf("llama", str(tmp_path / "hf"), seed=4)
    cfg = load_config("tiny_cpu", [f"actor.model.path={hf_dir}", "actor.model.arch=null", "actor.optim.lr=0.0",
                                   "actor.optim.weight_decay=0.0",
                                   f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    worker = ActorWorker(cfg, TINY_VOCAB)
    first = next(worker.model.parameters())
    assert first.dtype == torch.bfloat16 and first.is_cuda
    loaded = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    worker.optimizer.zero_grad()
    worker.optimizer.step()
    changed = [k for k, v in worker.model.named_parameters() if not torch.equal(v.detach(), loaded[k])]
    assert not changed, f"a zero-lr bf16 step changed {len(changed)} of {len(loaded)} tensors: {changed[:3]}"
