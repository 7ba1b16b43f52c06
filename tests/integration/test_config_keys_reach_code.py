"""Every config key reaches the code it names, or is refused by name: the proof that a key like
cluster.actor.use_distributed_optimizer (defaulted, documented, and once read by nothing) cannot come back.

Dynamic: attribute reads on the loaded config's dataclasses are recorded while `megatron-ppo train` (entry.main,
in-process) runs two tiny configurations that between them take every branch the driver has; reads made by the
config machinery itself (validation, YAML dump) do not count. What the runs cannot read is listed below, each with
its reason: keys behind a refused switch (the switch is checked to be refused), keys documented as having no effect
on one rank, and keys read only on a path the tiny runs do not take (the reading line is checked to exist).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from megatron_ppo import config as C
from megatron_ppo.config.verl_compat import reference_rows

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_ppo import VOWEL_REWARD, _overrides, data_dir  # noqa: E402,F401  (helpers and fixture reused)

REPO = Path(__file__).resolve().parents[2]
ARCH = "{num_layers: 2, hidden_size: 64, ffn_hidden_size: 256, num_attention_heads: 4, num_query_groups: 2, " \
       "max_position_embeddings: 512}"

# key prefix -> (the switch that the entry point refuses by name, overrides that turn it on); none at present
BEHIND_A_REFUSED_SWITCH: dict[str, tuple[str, list[str]]] = {}
# keys that cannot have an effect; docs/config.md lists each with the reason
NO_EFFECT = ("cluster.ref.use_distributed_optimizer", "cluster.reward.use_distributed_optimizer",
             "actor.entropy_from_logits_with_chunking")
# key -> (file, text of the line that reads it): read on a path the tiny runs do not take (an HF model directory)
READ_ON_ANOTHER_PATH = {
    "trainer.overwrite": ("megatron_ppo/trainer/tracking.py", "t.overwrite"),  # read only when records exist
    # offline runs, resume and checkpoint pruning have their own tests (test_trainer_offline.py,
    # test_trainer_resume.py); the two runs here neither read trajectories nor save
    "rollout.trajectory_files": ("megatron_ppo/trainer/components.py", "cfg.rollout.trajectory_files"),
    "trainer.resume_from_path": ("megatron_ppo/trainer/checkpoint.py", "t.resume_from_path"),
    # max_<role>_ckpt_to_keep of every trained role (roles.py)
    "trainer.max_actor_ckpt_to_keep": ("megatron_ppo/trainer/ppo.py", 'getattr(t, f"max_{role}_ckpt_to_keep")'),
    "trainer.max_critic_ckpt_to_keep": ("megatron_ppo/trainer/ppo.py", 'getattr(t, f"max_{role}_ckpt_to_keep")'),
    # rollout.name=vllm needs the vLLM venv: tests/integration/test_ppo_vllm.py and test_rollout_vllm.py run it
    **{f"rollout.vllm.{key}": ("megatron_ppo/rollout/vllm.py", text) for key, text in {
        "python": "engine_cfg.python or", "tensor_model_parallel_size": "e.tensor_model_parallel_size",
        "pipeline_model_parallel_size": "e.pipeline_model_parallel_size",
        "gpu_memory_utilization": "self.engine_cfg.gpu_memory_utilization", "cpu_kv_cache_gib": "e.cpu_kv_cache_gib",
        "max_num_seqs": "e.max_num_seqs",
        "weight_transport": "self.engine_cfg.weight_transport", "bucket_mb": "self.engine_cfg.bucket_mb",
        "weights_dir": "engine_cfg.weights_dir", "start_timeout_s": "e.start_timeout_s",
        "hang_timeout_s": "self.engine_cfg.hang_timeout_s",
        "cpu_threads_bind": "e.cpu_threads_bind is not None"}.items()},
    **{f"rollout.vllm.{key}": ("megatron_ppo/rollout/vllm_settings.py", f"v.{key}")
       for key in ("enforce_eager", "enable_prefix_caching", "free_cache_engine")},
    # read by a rank asked to profile a step: tests/integration/test_ppo_ray.py (global_profiler on Ray)
    "global_profiler.ranks": ("megatron_ppo/profiling.py", "cfg.global_profiler.ranks"),
    # read only with trainer.save_best, whose run test_trainer_save_best.py checks
    "trainer.best_metric": ("megatron_ppo/trainer/ppo.py", "validation_score(metrics, t.best_metric)"),
    # read only with trainer.async_rollout=one_step, which needs vLLM: tests/integration/test_ppo_one_step.py
    "trainer.max_staleness": ("megatron_ppo/trainer/ppo.py", "t.max_staleness < 1"),
}

COMMON = {"trainer.total_training_steps": 1, "trainer.test_freq": 1, "trainer.val_before_train": "true",
          "rollout.val_kwargs.do_sample": "true", "rollout.val_kwargs.temperature": 0.7, "rollout.val_kwargs.n": 2, "data.val_max_samples": 2}
RUNS = {
    "gae": {"critic.model.arch": ARCH, "ref.model.arch": ARCH, "ref.log_prob_micro_batch_size_per_gpu": 2,
            "actor.model.recompute_granularity": "full", "actor.model.recompute_method": "uniform",
            "actor.model.recompute_num_layers": 1, "critic.model.recompute_granularity": "full",
            "critic.model.recompute_method": "block", "critic.model.recompute_num_layers": 1,
            "ref.model.recompute_granularity": "full", "ref.model.recompute_method": "uniform",
            "ref.model.recompute_num_layers": 2,
            "actor.optim.lr_decay_style": "cosine", "critic.optim.lr_decay_style": "linear",
            "reward.repetition_penalty_coef": 0.1, "reward.length_penalty_coef": 0.1,
            "reward.length_penalty_buffer": 4,
            "algorithm.use_kl_in_reward": "true", "algorithm.kl_guard.enable": "true",
            "algorithm.kl_guard.target_kl": 10.0, "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_is_batch_normalize": "true",
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": 2.0,
            # token-budget micro-batches everywhere (the grpo run takes the fixed-size path)
            "actor.use_dynamic_bsz": "true", "critic.use_dynamic_bsz": "true", "ref.log_prob_use_dynamic_bsz": "true",
            "rollout.log_prob_use_dynamic_bsz": "true", "actor.ppo_max_token_len_per_gpu": 600,
            "critic.ppo_max_token_len_per_gpu": 600, "ref.log_prob_max_token_len_per_gpu": 600,
            "rollout.log_prob_max_token_len_per_gpu": 600, "trainer.balance_batch": "false"},
    "grpo": {"algorithm.adv_estimator": "grpo", "actor.model.recompute_granularity": "selective", "rollout.n": 2, "algorithm.norm_adv_by_std_in_grpo": "false",
             "reward.custom_reward_function.path": str(VOWEL_REWARD),
             "reward.custom_reward_function.name": "compute_score",
             "trainer.total_training_steps": "null", "data.train_max_samples": 4,  # total_epochs x 1 step
             # on Ray (one rank per role): the driver reads the cluster keys; the ranks' reads are not recorded
             # here, the gae run (in-process) records those
             "cluster.launcher": "ray", "cluster.placement": "split", "cluster.n_gpus_per_node": 2,
             "cluster.actor.data_parallel_size": 1, "cluster.ref.data_parallel_size": 1},
    # a reward model scores the responses (in-process, so the worker's reads are recorded); the actor trains in
    # bypass mode (rollout log-probs as old log-probs, the REINFORCE loss)
    "reward_model": {"algorithm.rollout_correction.bypass_mode": "true",
                     "algorithm.rollout_correction.loss_type": "reinforce",
                     "reward.reward_model.enable": "true", "reward.reward_model.model.arch": ARCH,
                     "reward.reward_model.micro_batch_size_per_gpu": 2, "algorithm.adv_estimator": "grpo",
                     "reward.reward_model.model.recompute_granularity": "full",
                     "reward.reward_model.model.recompute_method": "uniform",
                     "reward.reward_model.model.recompute_num_layers": 1,
                     "rollout.n": 2},
}


def _all_keys() -> list[str]:
    return [row[0] for row in reference_rows(C.PPOConfig, C.VERL_SECTIONS, C.VERL_KEYS)]


def _config_classes(cls=C.PPOConfig) -> set[type]:
    from megatron_ppo.config.io import _hints, _unwrap_optional

    out = {cls}
    for f in dataclasses.fields(cls):
        inner = _unwrap_optional(_hints(cls)[f.name])
        if dataclasses.is_dataclass(inner):
            out |= _config_classes(inner)
    return out


class ReadRecorder:
    """Records 'dotted.key' for each field read on the registered config tree, except reads by dataclass-generated
    methods (__eq__, __repr__) and by the config machinery (config/io.py: to_dict/YAML;
    config/checks.py: validation, except ``unsupported_settings``, whose reads refuse a key by name)."""

    MACHINERY = ("megatron_ppo/config/io.py", "megatron_ppo/config/checks.py")

    def __init__(self, monkeypatch):
        self.paths: dict[int, str] = {}
        self.reads: set[str] = set()
        for cls in _config_classes():
            monkeypatch.setattr(cls, "__getattribute__", self._getter({f.name for f in dataclasses.fields(cls)}),
                                raising=False)

    def register(self, cfg, prefix: str = "") -> None:
        self.paths[id(cfg)] = prefix
        for f in dataclasses.fields(cfg):
            value = object.__getattribute__(cfg, f.name)
            if dataclasses.is_dataclass(value):
                self.register(value, f"{prefix}{f.name}.")

    def _getter(self, names):
        recorder = self

        def __getattribute__(obj, name):
            if name in names and id(obj) in recorder.paths and recorder._by_product_code(sys._getframe(1)):
                recorder.reads.add(recorder.paths[id(obj)] + name)
            return object.__getattribute__(obj, name)
        return __getattribute__

    def _by_product_code(self, frame) -> bool:
        if frame.f_code.co_filename == "<string>":  # dataclass-generated __init__/__eq__/__repr__
            return False
        while frame is not None and frame.f_code.co_filename.endswith("dataclasses.py"):  # asdict: who asked?
            frame = frame.f_back
        if frame is not None and frame.f_code.co_name == "unsupported_settings":  # refused by name (config/checks.py)
            return True
        return frame is None or not frame.f_code.co_filename.endswith(self.MACHINERY)


def _run_main(overrides: list[str], recorder: ReadRecorder, monkeypatch) -> None:
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer import entry

    def load_and_register(*args, **kwargs):
        cfg = C.load_config(*args, **kwargs)
        recorder.register(cfg)
        return cfg

    monkeypatch.setattr(entry, "load_config", load_and_register)
    try:
        assert entry.main(overrides) == 0
    finally:
        disable_cpu_platform()


@pytest.mark.slow  # three tiny `megatron-ppo train` runs: ~35 s on 2 cores
def test_every_config_key_is_read_by_the_product_or_refused_by_name(data_dir, tmp_path, monkeypatch):
    from megatron_ppo.config.checks import unsupported_settings

    recorder = ReadRecorder(monkeypatch)
    for name, extra in RUNS.items():
        run_dir = tmp_path / name
        _run_main(_overrides(data_dir, run_dir, **{**COMMON, **extra}), recorder, monkeypatch)
        assert (run_dir / "logs" / "metrics.jsonl").read_text().count("\n") >= 1, name

    def listed(key):
        return (any(key.startswith(p) for p in BEHIND_A_REFUSED_SWITCH) or key in NO_EFFECT
                or key in READ_ON_ANOTHER_PATH)

    never_read = [key for key in _all_keys() if key not in recorder.reads and not listed(key)]
    assert never_read == [], f"config keys that no code reads and that nothing refuses: {never_read}"
    stale = [key for key in _all_keys() if key in recorder.reads and listed(key)]
    assert stale == [], f"keys listed as unread that the runs did read (drop them from the lists): {stale}"

    for prefix, (switch, on) in BEHIND_A_REFUSED_SWITCH.items():
        assert switch in unsupported_settings(C.load_config("tiny_cpu", on)), (prefix, switch)
    docs = (REPO / "docs" / "config.md").read_text()
    section = docs[docs.index("### Keys without effect"):]
    for key in NO_EFFECT:
        assert f"`{key}`" in section, key
    for key, (path, text) in READ_ON_ANOTHER_PATH.items():
        assert text in (REPO / path).read_text(), (key, path)


def test_use_distributed_optimizer_reaches_megatrons_optimizer(data_dir, tmp_path):
    """cluster.<role>.use_distributed_optimizer picks Megatron's DistributedOptimizer for that role (it used to be
    read by nothing: every worker was built with use_distributed_optimizer=False)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components

    def inner(worker):
        return getattr(worker.worker.optimizer, "chained_optimizers", [worker.worker.optimizer])

    cfg = C.load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{
        "cluster.actor.use_distributed_optimizer": "true", "cluster.critic.use_distributed_optimizer": "false"}))
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        parts.tracker.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    assert all(isinstance(o, DistributedOptimizer) for o in inner(parts.actor))
    assert not any(isinstance(o, DistributedOptimizer) for o in inner(parts.critic))
    assert parts.actor.worker.ddp.ddp_config.use_distributed_optimizer and not parts.critic.worker.ddp.ddp_config.use_distributed_optimizer
