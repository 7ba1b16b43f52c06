"""trainer.save_best on a real tiny run (megatron-core on CPU, gloo): the step that validated best is saved off
save_freq, kept beside the newest when max_*_ckpt_to_keep would prune it, named on disk (best_checkpointed_
iteration.txt, the ``best`` link), carried across a resume, and read by `megatron-ppo eval --model <dir>/best`.

The validation scores are scripted (PPOTrainer.validate returns the next one): a tiny random model scores 0 on every
prompt, and the logic under test is which step the trainer keeps for a given sequence of scores."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.trainer import checkpoint as ckpt
from megatron_ppo.trainer.ppo import PPOTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_resume import _overrides, _run, data_dir  # noqa: E402,F401  (helpers and fixture reused)

SCORES = {1: 0.5, 2: 0.4, 3: 0.6, 4: 0.3,  # the first run: steps 1 and 3 beat every earlier one; 3 is the best
          5: 0.55}  # after the resume: below step 3's 0.6, which only the checkpoint remembers


def _scripted(monkeypatch):
    monkeypatch.setattr(PPOTrainer, "validate",
                        lambda self, announce_as=None: {"val/test_score/gsm8k": SCORES[self.step]})


def test_the_best_step_is_kept_beside_the_newest_across_a_resume_and_eval_reads_it(data_dir, tmp_path, monkeypatch):
    _scripted(monkeypatch)
    # save_freq is the last step only: steps 1 and 3 are saved because they validated best
    over = {"trainer.test_freq": 1, "trainer.save_best": True, "trainer.save_freq": 4,
            "trainer.total_training_steps": 4, "trainer.max_actor_ckpt_to_keep": 1,
            "trainer.max_critic_ckpt_to_keep": 1}
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **over))
    root = tmp_path / "ckpt"
    _run(cfg, 4)
    assert ckpt.complete_steps(str(root)) == [3, 4]  # keep=1 alone would leave only step 4; step 1 was the best once
    assert ckpt.best_step(str(root)) == 3 and os.readlink(root / "best") == "global_step_3"
    state = json.loads((root / "global_step_4" / ckpt.DRIVER_STATE).read_text())
    assert state["best"] == {"step": 3, "score": 0.6}

    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{**over, "trainer.total_training_steps": 5,
                                                                       "trainer.save_freq": 5}))
    _run(cfg, 5, resume=str(root / "global_step_4"))
    assert ckpt.complete_steps(str(root)) == [3, 5]  # a resume that forgot the best would keep step 5 (0.55) only
    assert ckpt.best_step(str(root)) == 3

    # eval of <dir>/best: the link resolves to the step, which is verified against its manifest and names the output
    from megatron_ppo.evaluation.cli import eval_config

    args = argparse.Namespace(model=str(root / "best"), config=None, overrides=[], data=[str(data_dir / "test.parquet")],
                              n=2, out=None)
    eval_cfg, role_dir = eval_config(args)
    assert Path(role_dir) == root / "global_step_3" / "actor"
    assert eval_cfg.trainer.log_dir.endswith("-global_step_3")
    (root / "global_step_3" / ckpt.RUN_CONFIG).write_text("damaged: true\n")  # not its manifest's size
    with pytest.raises(ckpt.CheckpointError, match="global_step_3"):
        eval_config(argparse.Namespace(**{**vars(args), "model": str(root / "best")}))


def test_save_best_without_validation_is_refused_by_name(data_dir, tmp_path):
    from megatron_ppo.errors import UsageError

    with pytest.raises(UsageError, match="trainer.save_best"):
        load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{"trainer.save_best": True}))
