"""trainer.save_best's pure parts: which number a validation scores, which step is the best, and the on-disk pointer
(best_checkpointed_iteration.txt and the ``best`` link) that readers resolve to the real step."""
from __future__ import annotations

import math
import os

import pytest

from megatron_ppo.errors import UsageError
from megatron_ppo.trainer import checkpoint as ckpt
from megatron_ppo.trainer.best import BestValidation, validation_score


def test_the_default_score_is_the_mean_over_data_sources_and_a_step_without_validation_has_none():
    metrics = {"val/test_score/a": 0.2, "val/test_score/b": 0.6, "actor/entropy": 3.0}
    assert validation_score(metrics, None) == pytest.approx(0.4)
    assert validation_score(metrics, "val/test_score/b") == 0.6
    assert validation_score({"actor/entropy": 3.0}, None) is None
    assert validation_score({"actor/entropy": 3.0}, "val/test_score/a") is None  # did not validate this step


def test_a_named_metric_the_validation_did_not_log_is_refused_listing_what_it_logged():
    with pytest.raises(UsageError, match=r"trainer.best_metric='val/acc'.*val/test_score/a"):
        validation_score({"val/test_score/a": 0.2}, "val/acc")


def test_only_a_finite_score_above_every_earlier_one_improves():
    best = BestValidation()
    assert not best.improved_by(None) and not best.improved_by(math.nan)
    assert best.improved_by(0.0)
    best = BestValidation(3, 0.5)
    assert not best.improved_by(0.5) and not best.improved_by(0.4) and not best.improved_by(math.inf)
    assert best.improved_by(0.51)
    assert BestValidation.from_state(best.state_dict()) == best
    assert BestValidation.from_state(None) == BestValidation()  # a checkpoint saved before save_best


def test_mark_best_points_file_and_link_at_the_step_and_readers_resolve_the_link(tmp_path):
    root = str(tmp_path)
    for step in (2, 5):
        os.makedirs(os.path.join(ckpt.step_dir(root, step), "actor"))
    ckpt.mark_best(root, 2)
    ckpt.mark_best(root, 5)  # replaced, not appended to
    assert ckpt.best_step(root) == 5 and os.readlink(tmp_path / "best") == "global_step_5"
    assert ckpt.resolve_link(str(tmp_path / "best")) == os.path.realpath(ckpt.step_dir(root, 5))
    assert ckpt.resolve_link(str(tmp_path / "best" / "actor")).endswith("global_step_5/actor")
    other = tmp_path / "hf"
    other.mkdir()
    os.symlink(other, tmp_path / "model-link")
    assert ckpt.resolve_link(str(tmp_path / "model-link")) == str(tmp_path / "model-link")  # not a checkpoint
    ckpt.mark_best(root, None)
    assert ckpt.best_step(root) is None and not os.path.lexists(tmp_path / "best")


def test_prune_keeps_a_protected_step_beyond_max_ckpt_to_keep(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        d = ckpt.step_dir(root, step)
        os.makedirs(os.path.join(d, "actor"))
        open(os.path.join(d, ckpt.DRIVER_STATE), "w").close()
    assert ckpt.complete_steps(root) == [1, 2, 3, 4]
    ckpt.prune(root, {"actor": 1}, current=4, protect=(2,))
    assert ckpt.complete_steps(root) == [2, 4]
