"""The rollout seam (megatron_ppo/rollout/): the engine protocol and its one config key, algorithm-level sampling
built once by the driver, the one replica-seed rule, the online/offline sources, and RolloutBatch.select (what
crosses the driver -> rank boundary)."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.distributed.dispatch import restore_rows, select_rows
from megatron_ppo.distributed.layout import dp_seed
from megatron_ppo.rollout import ENGINES, RolloutEngine, SamplingParams, build_engine, replica_seed
from megatron_ppo.rollout.source import OfflineSource, sampling_params
from megatron_ppo.workers.update import UpdateResult


def test_engines_chosen_by_rollout_name():
    from megatron_ppo.rollout.generation import DecodeOptions
    from megatron_ppo.rollout.megatron import MegatronEngine
    from megatron_ppo.rollout.vllm import VllmEngine

    assert list(ENGINES) == ["megatron", "vllm"] and load_config("tiny_cpu", []).rollout.name == "megatron"
    engine = MegatronEngine(lambda: None, DecodeOptions())
    assert isinstance(engine, RolloutEngine)
    assert engine.sync_weights() is None  # shares the actor's weights: nothing to copy
    assert all(callable(getattr(VllmEngine, m, None)) for m in ("generate", "sync_weights", "close"))
    with pytest.raises(ValueError, match=r"rollout.name='sglang': no such rollout engine; choose one of "
                                         r"\['megatron', 'vllm'\]"):
        build_engine("sglang", None, None)
    with pytest.raises(ConfigError, match="rollout.name"):
        load_config("tiny_cpu", ["rollout.name=sglang"])


def test_engine_options_come_from_its_own_section_and_the_workers_gemm_choice():
    from megatron_ppo.rollout.megatron import decode_options

    cfg = load_config("tiny_cpu", ["rollout.megatron.prefill=aligned", "rollout.megatron.drop_finished=false",
                                   "rollout.megatron.use_torch_compile=true"])
    opts = decode_options(cfg.rollout.megatron, onednn=False, cpu_gemm="torch")
    assert (opts.prefill, opts.drop_finished, opts.compile_decode) == ("aligned", False, True)
    assert (opts.onednn_prefill, opts.packed_linears) == (False, False)
    assert decode_options(cfg.rollout.megatron, onednn=True, cpu_gemm="auto").packed_linears


def test_sampling_params_are_algorithm_level_only():
    cfg = load_config("tiny_cpu", ["rollout.top_k=-1", "rollout.temperature=0.7"])
    p = sampling_params(cfg.rollout, 12, [2], 0)
    assert (p.max_response_length, p.temperature, p.top_k, p.greedy, p.eos_token_ids, p.seed) == (12, 0.7, 0, False,
                                                                                                 (2,), 0)
    greedy = sampling_params(cfg.rollout.val_kwargs, 12, [2], 0)  # val_kwargs: do_sample false
    assert greedy.greedy and greedy.temperature == 1.0
    assert set(SamplingParams.__dataclass_fields__) == {"max_response_length", "temperature", "top_k", "top_p",
                                                        "greedy", "eos_token_ids", "pad_token_id", "seed"}


def test_replica_seed_is_the_one_rule():
    """The seed rule before issue 24 (driver: trainer.seed x 100003; actor: + 1000 x dp x step, then dp_seed)."""
    for seed, step, dp, rank in ((1, 0, 1, 0), (42, 3, 2, 1), (7, 10, 4, 3)):
        assert replica_seed(seed, step, dp, rank) == dp_seed(seed * 100003 + 1000 * dp * step, rank)
    seeds = {replica_seed(42, step, 2, rank) for step in range(3) for rank in range(2)}
    assert len(seeds) == 6  # different per replica and step


def _batch():
    prompts = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6])]
    responses = torch.tensor([[7, 8, 0], [9, 0, 0], [1, 2, 3]])
    mask = (responses > 0).float()
    return RolloutBatch(prompts, responses, mask, {"advantages": torch.arange(9.).reshape(3, 3),
                                                   "values": torch.ones(3, 3)},
                        {"data_source": ["a", "b", "c"]})


def test_select_rows_keys_and_meta():
    b = _batch()
    assert b.row_tokens() == [4, 2, 6] and b.num_tokens([0, 2]) == 10
    sub = b.select([2, 0], keys=("advantages",), meta=False)
    assert [p.tolist() for p in sub.prompt_ids] == [[4, 5, 6], [1, 2]]
    assert sub.responses.tolist() == [[1, 2, 3], [7, 8, 0]] and list(sub.tensors) == ["advantages"]
    assert sub.tensors["advantages"][0].tolist() == [6., 7., 8.] and sub.meta == {}
    assert b.select([1]).meta == {"data_source": ["b"]} and set(b.select([1]).tensors) == {"advantages", "values"}
    b.tensors["loss_mask"] = b.response_mask.clone()
    assert set(b.select(keys=()).tensors) == {"loss_mask"}  # rejection's mask always travels


def test_a_rollout_batch_splits_over_dp_and_comes_back_in_order():
    b = _batch()
    shards = [[0, 2], [1]]
    parts = [select_rows(b.select(keys=("values",), meta=False), rows) for rows in shards]
    assert [p.size for p in parts] == [2, 1] and all(isinstance(p, RolloutBatch) for p in parts)
    back = restore_rows([{"r": p.responses} for p in parts], shards)
    assert torch.equal(back["r"], b.responses)


def test_offline_source_replays_without_a_sentinel(tmp_path):
    class Rows:  # OfflineTrajectories' interface: len(), rows(indices), pad_token_id
        pad_token_id = 0
        items = [{"prompt_ids": [1, 2], "response_ids": [5, 6], "rollout_log_probs": [-0.5, -1.0], "raw_prompt": "p",
                  "data_source": "d", "reward_model": {}, "extra_info": {}, "source": "f: row 0", "reward": 1.0}]

        def __len__(self):
            return 1

        def rows(self, indices):
            return [self.items[i] for i in indices]

    source = OfflineSource(Rows())
    batch = source.batch([0], step=3)
    assert source.kind == "offline" and len(source) == 1
    assert batch.responses.tolist() == [[5, 6]] and batch.meta["stored_reward"] == [1.0]
    assert batch.tensors["rollout_log_probs"].tolist() == [[-0.5, -1.0]] and batch.meta["uid"] == ["3-0"]


def test_update_result_is_typed():
    r = UpdateResult(metrics={"critic/vf_loss": 0.5}, optimizer_steps=2, nonfinite_skips=1,
                     nonfinite_losses=[float("inf")], nonfinite_grad_norms=[float("nan")])
    assert r.nonfinite_detail() == "1 of 2 updates skipped; their loss [inf], grad_norm [nan]"
    assert not any(k.startswith("_") for k in r.metrics)
