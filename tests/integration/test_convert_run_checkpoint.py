"""`megatron-ppo convert mcore-to-hf` of a training run's actor checkpoint (`<default_local_dir>/global_step_N/actor`):
the exported HF model's logits equal the trained actor's (not the initial HF model's)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_ppo.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_resume import _overrides  # noqa: E402


@pytest.mark.slow
def test_mcore_to_hf_exports_the_trained_actor_of_a_run(tmp_path, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from megatron_ppo import parallel
    from megatron_ppo.convert.cli import main as convert_main
    from megatron_ppo.convert.verify import megatron_logits
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False, rms_norm_eps=1e-6)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    data_dir = tmp_path_factory.mktemp("convert_data")
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{
        "actor.model.path": str(tmp_path / "hf"), "actor.model.arch": "null", "trainer.total_training_steps": 1,
        "trainer.save_freq": 1, "actor.optim.lr": 1e-2, "actor.optim.lr_warmup_steps": -1}))
    tokens = torch.randint(0, 2048, (2, 12))
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        try:
            before = megatron_logits(parts.actor.worker.model, tokens, 2048)
            PPOTrainer(cfg, parts).fit(1)
            trained = megatron_logits(parts.actor.worker.model, tokens, 2048)
        finally:
            parts.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    assert (trained - before).abs().max().item() > 1e-3  # the step moved the actor

    actor_dir = tmp_path / "ckpt" / "global_step_1" / "actor"
    assert (actor_dir / "hf_config" / "config.json").is_file()
    assert convert_main(["mcore-to-hf", "--mcore", str(actor_dir), "--out", str(tmp_path / "export"),
                         "--quiet"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        got = exported(tokens).logits.float()
    assert (got - trained).abs().max().item() <= 1e-4
