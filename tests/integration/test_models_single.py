"""Single-process megatron-core model checks (world of one, CPU platform layer): attention, packing, recompute,
roles, and architecture options against independent references (megatron's own local attention, HF forwards)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch

# Not slow: one process, a few seconds in all once megatron-core is imported (pytest.ini: slow = multi-process or
# minute-long).


def _build(arch, role="actor", **kw):
    from megatron_ppo.models.gpt import build_gpt_model

    return build_gpt_model(arch, role, **kw)


def _set_thd_strategy(model, strategy):
    from megatron_ppo.models.attention import SDPACoreAttention

    for m in model.modules():
        if isinstance(m, SDPACoreAttention):
            m.thd_strategy = strategy


def test_sdpa_core_attention_matches_megatron_local_attention(megatron_single):
    """Same weights through megatron's stock local spec (DotProductAttention, unfused softmax) and ours (SDPA)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ppo.models.gpt import transformer_config

    arch = tiny_arch()  # GQA: 4 heads, 2 groups
    ours = _build(arch)
    stock = GPTModel(config=transformer_config(arch), vocab_size=arch.padded_vocab_size(1),
                     transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     max_sequence_length=arch.max_position_embeddings, position_embedding_type="rope")
    stock.load_state_dict(ours.state_dict())
    ids = torch.randint(0, arch.vocab_size, (3, 21), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids, None, None), stock(ids, None, None), atol=2e-5, rtol=0)
    # explicit padding mask (left padding): compare the valid positions
    keep = torch.ones(3, 21, dtype=torch.bool)
    keep[0, :4] = False
    keep[2, :9] = False
    causal = torch.tril(torch.ones(21, 21, dtype=torch.bool))
    mask = ~(causal & keep[:, None, None, :])  # megatron convention: True = masked
    a, b = ours(ids, None, mask), stock(ids, None, mask)
    torch.testing.assert_close(a[keep], b[keep], atol=2e-5, rtol=0)


def test_fully_masked_rows_give_no_nan_and_left_padding_equals_unpadded(megatron_single):
    arch = tiny_arch()
    model = _build(arch)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in (6, 13)]
    S = 13
    ids = torch.zeros(2, S, dtype=torch.long)
    keep = torch.zeros(2, S, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, S - len(s):] = s
        keep[i, S - len(s):] = True
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
    mask = ~(causal & keep[:, None, None, :])
    logits = model(ids, None, mask)
    logits.sum().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    for i, s in enumerate(seqs):  # RoPE is relative: a left shift leaves the valid tokens' outputs unchanged
        alone = model(s.unsqueeze(0), None, None)[0]
        torch.testing.assert_close(logits[i, S - len(s):], alone, atol=2e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["per_sequence", "padded", "block_mask", "flex"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_packed_thd_equals_padded(megatron_single, strategy, role):
    from megatron_ppo.models.forward import model_forward, pack_sequences
    from megatron_ppo.models.logprobs import next_token_targets, vocab_parallel_logprobs_entropy

    arch = tiny_arch(vocab_size=500)
    model = _build(arch, role)
    _set_thd_strategy(model, strategy)
    g = torch.Generator().manual_seed(2)
    lens = [5, 12, 1, 7]
    seqs = [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lens]
    padded = torch.zeros(len(seqs), max(lens), dtype=torch.long)
    valid = torch.zeros_like(padded, dtype=torch.bool)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
        valid[i, :len(s)] = True
    ids, cu = pack_sequences(seqs)

    out_pad = model_forward(model, {"input_ids": padded})
    with torch.no_grad() if strategy == "flex" else contextlib.nullcontext():  # flex: no backward on the CPU
        out_pack = model_forward(model, {"input_ids": ids, "cu_seqlens": cu})[0]
    torch.testing.assert_close(out_pack, out_pad[valid], atol=2e-5, rtol=0)
    if strategy == "flex":
        return  # torch's FlexAttention has no backward on the CPU (test_models_gpu runs it)

    def objective(out, input_ids, cu_seqlens):
        if role == "critic":
            return out.squeeze(-1).sum()
        t, v = next_token_targets(input_ids, cu_seqlens)
        logp, ent = vocab_parallel_logprobs_entropy(out, t, vocab_size=arch.vocab_size)
        return ((logp + 0.3 * ent) * v).sum()

    model.zero_grad()
    if role == "actor":  # padded rows: mask out pad positions by hand (targets of the row's last valid token too)
        t, v = next_token_targets(padded)
        v = v & valid & torch.roll(valid, -1, dims=1)
        logp, ent = vocab_parallel_logprobs_entropy(model_forward(model, {"input_ids": padded}), t,
                                                    vocab_size=arch.vocab_size)
        ((logp + 0.3 * ent) * v).sum().backward()
    else:
        (model_forward(model, {"input_ids": padded}).squeeze(-1) * valid).sum().backward()
    grads_pad = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    objective(model_forward(model, {"input_ids": ids, "cu_seqlens": cu}), ids, cu).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_pad[n], atol=5e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_identical_gradients_with_dropout(megatron_single, recompute):
    from megatron_ppo import parallel

    arch = tiny_arch(attention_dropout=0.2, hidden_dropout=0.2)
    ids = torch.randint(0, arch.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    grads = {}
    for mode in (None, recompute):
        parallel.seed_everything(5)
        model = _build(arch, recompute=mode)
        assert model.config.recompute_granularity == mode
        model.train()
        parallel.seed_everything(6)  # same dropout masks in both runs
        model(ids, None, None).pow(2).mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, g in grads[None].items():
        torch.testing.assert_close(grads[recompute][n], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    # and dropout is really on: another seed changes the gradient
    parallel.seed_everything(5)
    model = _build(arch)
    parallel.seed_everything(7)
    model(ids, None, None).pow(2).mean().backward()
    first = next(iter(grads[None]))
    assert not torch.allclose(dict(model.named_parameters())[first].grad, grads[None][first])


def test_roles(megatron_single):
    from megatron_ppo.models.gpt import reward_scores
    from megatron_ppo.models.layers import ValueHead

    arch = tiny_arch(tie_word_embeddings=True)
    ids = torch.randint(0, arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    actor = _build(arch, "actor")
    assert actor.share_embeddings_and_output_weights and actor(ids, None, None).shape == (2, 9, 512)
    ref = _build(arch, "ref")
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    critic = _build(arch, "critic", value_head_bias=True)
    assert isinstance(critic.output_layer, ValueHead) and not critic.share_embeddings_and_output_weights
    values = critic(ids, None, None)
    assert values.shape == (2, 9, 1) and values.dtype == torch.float32
    reward = _build(arch, "reward")
    v = reward(ids, None, None).squeeze(-1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0], [0] * 9], dtype=torch.bool)
    scores = reward_scores(v, mask)
    assert scores[0] == v[0, 4] and scores[1] == 0
    with pytest.raises(ValueError, match="role"):
        _build(arch, "policy")


def _hf_copy_from_megatron(model, hf, arch):
    """Map our megatron weights into an HF Llama/Qwen2 model (the QKV layout: per query group [q..., k, v])."""
    sd = {k: v.double() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    nh, ng, hd, h, f = arch.num_attention_heads, arch.num_query_groups, arch.head_dim, arch.hidden_size, arch.ffn_hidden_size
    q_per = nh // ng * hd
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(sd["embedding.word_embeddings.weight"][:arch.vocab_size])
        if not arch.tie_word_embeddings:
            hf.lm_head.weight.copy_(sd["output_layer.weight"][:arch.vocab_size])
        hf.model.norm.weight.copy_(sd["decoder.final_layernorm.weight"])
        for i, layer in enumerate(hf.model.layers):
            p = f"decoder.layers.{i}."
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[p + "pre_mlp_layernorm.weight"])
            qkv = sd[p + "self_attention.linear_qkv.weight"].view(ng, q_per + 2 * hd, h)
            att = layer.self_attn
            att.q_proj.weight.copy_(qkv[:, :q_per].reshape(-1, h))
            att.k_proj.weight.copy_(qkv[:, q_per:q_per + hd].reshape(-1, h))
            att.v_proj.weight.copy_(qkv[:, q_per + hd:].reshape(-1, h))
            if arch.add_qkv_bias:
                b = sd[p + "self_attention.linear_qkv.bias"].view(ng, q_per + 2 * hd)
                att.q_proj.bias.copy_(b[:, :q_per].reshape(-1))
                att.k_proj.bias.copy_(b[:, q_per:q_per + hd].reshape(-1))
                att.v_proj.bias.copy_(b[:, q_per + hd:].reshape(-1))
            att.o_proj.weight.copy_(sd[p + "self_attention.linear_proj.weight"])
            fc1 = sd[p + "mlp.linear_fc1.weight"]
            layer.mlp.gate_proj.weight.copy_(fc1[:f])
            layer.mlp.up_proj.weight.copy_(fc1[f:])
            layer.mlp.down_proj.weight.copy_(sd[p + "mlp.linear_fc2.weight"])


@pytest.mark.parametrize("family", ["llama3_rope_untied", "qwen2_bias_tied", "linear_rope"])
def test_architecture_options_match_hf_forward(megatron_single, family):
    """RMSNorm, SwiGLU, GQA, RoPE base and scaling, QKV bias, tied/untied embeddings vs transformers' forward."""
    import transformers

    common = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    if family == "llama3_rope_untied":
        rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                "original_max_position_embeddings": 32}
        hf_cfg = transformers.LlamaConfig(**common, rope_theta=5000.0, rope_scaling=rope, tie_word_embeddings=False)
        arch_kw = dict(rotary_base=5000.0, rope_scaling=rope, tie_word_embeddings=False)
        hf_cls = transformers.LlamaForCausalLM
    elif family == "linear_rope":
        rope = {"rope_type": "linear", "factor": 2.0}
        hf_cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope, tie_word_embeddings=False)
        arch_kw = dict(rotary_base=10000.0, rope_scaling=rope, tie_word_embeddings=False)
        hf_cls = transformers.LlamaForCausalLM
    else:
        hf_cfg = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True)
        arch_kw = dict(rotary_base=1e6, add_qkv_bias=True, tie_word_embeddings=True)
        hf_cls = transformers.Qwen2ForCausalLM
    arch = tiny_arch(vocab_size=500, ffn_hidden_size=96, norm_epsilon=1e-5, **arch_kw)
    model = _build(arch).double()
    if arch.add_qkv_bias:  # megatron initialises biases to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("linear_qkv.bias"):
                    p.normal_(0, 0.5)
    hf = hf_cls(hf_cfg).double().eval()
    _hf_copy_from_megatron(model, hf, arch)
    ids = torch.randint(0, arch.vocab_size, (2, 80), generator=torch.Generator().manual_seed(5))
    ours = model(ids, None, None)[..., :arch.vocab_size]
    torch.testing.assert_close(ours, hf(ids).logits, atol=1e-9, rtol=0)
