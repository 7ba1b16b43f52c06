"""A rank's slices of an HF checkpoint (convert/mapping.row_segments, convert/hf_slices): pure, on tiny shapes.

Every TP shard megatron cuts (rows of qkv per query group, within one group when TP exceeds the groups, the SwiGLU
2 x TP chunks, row-parallel columns, vocab rows with padding) is rebuilt from its segments exactly as the full
conversion (``to_mcore``) would cut it, and the ranks' reads tile every HF tensor once. The role-wide check
(``check_role_reads``) refuses a tensor read by no rank, read twice, or a model tensor the HF config does not have.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from megatron_ppo.convert.hf_io import HFCheckpoint
from megatron_ppo.convert.hf_slices import check_role_reads, plan_box, tensor_maps
from megatron_ppo.convert.mapping import (ConversionError, arch_from_hf_config, conversion_pieces, hf_tensor_shapes,
                                          row_segments, to_mcore)
from megatron_ppo.convert.mcore_io import chunk_coverage_problems

BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=48,
            intermediate_size=40, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
ARCHS = {  # name: (config, the TP sizes to cut it at)
    "gqa": (BASE, (1, 2, 4)),  # TP=4 > 2 groups: a rank holds part of one group's q, and its k, v rows twice over
    "mha_qwen2_bias": ({**BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 8,
                        "tie_word_embeddings": True}, (2, 8)),
}


def _hf(arch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_tensor_shapes(arch).items()}


def _boxes(m, arch, tp):
    """Each TP rank's (rows, cols) of one layer's Megatron tensor, as megatron cuts it."""
    rows = m.shape[0] if m.kind != "vocab" else arch.padded_vocab_size(tp)
    if m.tp_axis is None:
        return [[((0, rows), None)] for _ in range(tp)]
    if m.kind == "gate_up":  # SwiGLU: chunks r and tp + r of 2 x tp
        n = rows // (2 * tp)
        return [[((r * n, (r + 1) * n), None), (((tp + r) * n, (tp + r + 1) * n), None)] for r in range(tp)]
    if m.tp_axis == 0:
        n = rows // tp
        return [[((r * n, (r + 1) * n), None)] for r in range(tp)]
    n = m.shape[1] // tp
    return [[((0, rows), slice(r * n, (r + 1) * n))] for r in range(tp)]


def _assemble(m, arch, hf, r0, r1, cols, reads):
    """Rows [r0, r1) (columns ``cols``) of m's Megatron tensor built from its segments; each HF box read is noted."""
    segs = row_segments(m, arch, r0, r1)
    parts = []
    for seg in segs:
        if seg.hf_name is None:
            width = hf[m.hf_names[0]].shape[1:] if cols is None else (cols.stop - cols.start,)
            parts.append(torch.zeros((seg.stop - seg.start, *width)))
            continue
        src = hf[seg.hf_name][seg.start: seg.stop]
        src = src if cols is None else src[:, cols]
        parts.append(src)
        off = (seg.start,) + ((cols.start if cols is not None else 0,) if src.dim() > 1 else ())
        reads.setdefault(seg.hf_name, []).append((off, tuple(src.shape)))
    assert [s.dst for s in segs] == [sum(p.shape[0] for p in parts[:i]) for i in range(len(parts))]
    return torch.cat(parts)


@pytest.mark.parametrize("name", ARCHS)
def test_every_tp_shard_is_rebuilt_from_its_segments_and_the_reads_tile_the_hf_tensors(name):
    config, tps = ARCHS[name]
    arch = arch_from_hf_config(config)
    hf = _hf(arch)
    for tp in tps:
        reads: dict[str, list] = {}
        for piece in conversion_pieces(arch, tp):
            for m in piece.maps:
                full = to_mcore(m, hf, arch)
                for r, rank_boxes in enumerate(_boxes(m, arch, tp)):
                    for (r0, r1), cols in rank_boxes:
                        # a replicated tensor: rank 0's reads are the main replica's, the others' are copies
                        got = _assemble(m, arch, hf, r0, r1, cols, reads if m.tp_axis is not None or r == 0 else {})
                        want = full[r0:r1] if cols is None else full[r0:r1, cols]
                        assert torch.equal(got, want), (name, tp, m.mcore_key, r0, r1, cols)
        for n, shape in hf_tensor_shapes(arch).items():
            assert chunk_coverage_problems(shape, reads[n]) is None, (name, tp, n)


@pytest.mark.parametrize("kind", ["qkv", "vocab", "gate_up"])
def test_any_row_range_is_the_full_tensors_rows(kind):
    arch = arch_from_hf_config(BASE)
    hf = _hf(arch, seed=1)
    m = next(m for p in conversion_pieces(arch, 2) for m in p.maps if m.kind == kind)
    full = to_mcore(m, hf, arch)
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        r0, r1 = sorted(torch.randint(0, full.shape[0] + 1, (2,), generator=g).tolist())
        segs = row_segments(m, arch, r0, r1)
        got = torch.cat([hf[s.hf_name][s.start:s.stop] if s.hf_name else torch.zeros(s.stop - s.start, full.shape[1])
                         for s in segs]) if segs else full[:0]
        assert [s.dst for s in segs] == sorted(s.dst for s in segs)
        assert torch.equal(got, full[r0:r1]), (kind, r0, r1)


# ---------------------------------------------------------------------------------------------------------------
# The role-wide check, on megatron ShardedTensor metadata as a model at TP=2 describes it
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    arch = arch_from_hf_config(BASE)
    d = tmp_path_factory.mktemp("hf")
    save_file({n: torch.zeros(s) for n, s in hf_tensor_shapes(arch).items()}, str(d / "model.safetensors"))
    ck = HFCheckpoint(str(d))
    ranks = [[], []]
    L = arch.num_layers
    for piece in conversion_pieces(arch, 2):
        for m in piece.maps:
            for layer in range(L) if m.layer is not None else [None]:
                if m.layer is not None and layer != m.layer:
                    continue
                for r, rank_boxes in enumerate(_boxes(m, arch, 2)):
                    for (r0, r1), cols in rank_boxes:
                        size = (r1 - r0,) + ((m.shape[1] if cols is None else cols.stop - cols.start,)
                                             if len(m.shape) > 1 else ())
                        rows = arch.padded_vocab_size(2) if m.kind == "vocab" else m.shape[0]
                        shape = (rows,) + tuple(m.shape[1:])
                        off = (r0,) + (((cols.start if cols is not None else 0),) if len(m.shape) > 1 else ())
                        lead = (L,) if layer is not None else ()
                        ranks[r].append(ShardedTensor(
                            m.mcore_key, torch.empty(size), torch.float32, size, lead + shape,
                            ((layer,) if layer is not None else ()) + off, None,
                            replica_id=(0, r if m.tp_axis is None else 0, 0), prepend_axis_num=len(lead)))
    return arch, ck, ranks


def test_role_reads_complete_and_balanced(tp2):
    arch, ck, ranks = tp2
    params_in, padding = check_role_reads(arch, ck, ranks, tensor_maps(arch), set())
    assert params_in == sum(torch.Size(s).numel() for s in hf_tensor_shapes(arch).values())
    assert padding == 2 * (arch.padded_vocab_size(2) - arch.vocab_size) * arch.hidden_size  # embedding + lm_head


def test_role_reads_refuse_a_tensor_no_rank_reads(tp2):
    arch, ck, ranks = tp2
    kept = [[sh for sh in ranks[0] if sh.key != "output_layer.weight"], ranks[1]]
    with pytest.raises(ConversionError, match=r"'lm_head.weight': chunks cover"):
        check_role_reads(arch, ck, kept, tensor_maps(arch), set())
    gone = [[sh for sh in r if sh.key != "output_layer.weight"] for r in ranks]
    with pytest.raises(ConversionError, match=r"'lm_head.weight' is read by no rank"):
        check_role_reads(arch, ck, gone, tensor_maps(arch), set())
    check_role_reads(arch, ck, gone, tensor_maps(arch), {"lm_head.weight"})  # a critic's head: skipped on purpose


def test_role_reads_refuse_a_tensor_read_twice(tp2):
    arch, ck, ranks = tp2
    twice = [ranks[0], ranks[1] + [sh for sh in ranks[0] if sh.key == "decoder.final_layernorm.weight"]]
    with pytest.raises(ConversionError, match=r"'model.norm.weight': chunks at .* overlap"):
        check_role_reads(arch, ck, twice, tensor_maps(arch), set())


def test_a_model_tensor_the_hf_config_lacks_or_shapes_otherwise_is_named(tp2):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    arch, ck, _ = tp2
    maps = tensor_maps(arch)
    stranger = ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc3.weight", torch.empty(4, 4),
                                               (0, 0, arch.num_layers), prepend_axis_num=1)
    with pytest.raises(ConversionError, match=r"'decoder.layers.mlp.linear_fc3.weight' \(layer 0\): no HF tensor"):
        plan_box(stranger, maps, arch)
    wide = ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", torch.empty(arch.hidden_size + 1))
    with pytest.raises(ConversionError, match=r"final_layernorm.weight.*global shape \(49,\).*is \(48,\)"):
        plan_box(wide, maps, arch)
    other_vocab = ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", torch.empty(299, 48))
    with pytest.raises(ConversionError, match=r"embedding.word_embeddings.weight.*global shape \(299, 48\)"):
        plan_box(other_vocab, maps, arch)
