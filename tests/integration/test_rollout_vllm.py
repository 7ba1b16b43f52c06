"""The vLLM rollout engine (rollout/vllm.py) with a real vLLM (its own venv: make setup-vllm), on SmolLM2-135M-Instruct
in fp32: greedy responses equal the Megatron engine's for 16 GSM8K prompts (or the first divergence is a near tie of
HF's own logits); sampled log-probs equal the actor's teacher-forced recompute to 1e-4; an update is refused until
synced, and after the sync the engine's log-probs are the updated actor's; a killed, hung or failing engine is an
error naming the engine and replica, with no process left.

The PPO run through ``megatron-ppo train`` (TP2 actor -> vLLM) is tests/integration/test_ppo_vllm.py.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_ppo.config import load_config
from megatron_ppo.rollout import SamplingParams
from megatron_ppo.testing.processes import wait_gone

sys.path.insert(0, str(Path(__file__).parent))
from vllm_env import vllm_python  # noqa: E402

pytestmark = pytest.mark.slow

N_PROMPTS = 16
NEW = 32
LOGPROB_TOL = 1e-4  # fp32


def _gsm8k_prompt_ids(tok, n: int) -> list[torch.Tensor]:
    from megatron_ppo.data.gsm8k import INSTRUCTION, default_gsm8k_dir

    rows = [json.loads(line) for line in (default_gsm8k_dir() / "test.jsonl").open()][:n]
    return [torch.tensor(tok.apply_chat_template([{"role": "user", "content": r["question"] + " " + INSTRUCTION}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))
            for r in rows]


@pytest.fixture(scope="module")
def smollm2_actor(tmp_path_factory):
    """An in-process actor rank (LocalWorkerGroup) on SmolLM2 with rollout.name=vllm, its tokenizer and prompts."""
    from transformers import AutoTokenizer

    from megatron_ppo.distributed.group import LocalWorkerGroup
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.workers.actor import ActorWorker
    from test_convert_smollm2 import smollm2_hf_dir

    python = vllm_python()
    hf_dir = str(smollm2_hf_dir())
    tmp = tmp_path_factory.mktemp("vllm_actor")
    cfg = load_config("tiny_cpu", [
        f"actor.model.path={hf_dir}", "actor.model.arch=null", f"rollout.vllm.python={python}",
        "rollout.name=vllm", "data.max_prompt_length=320", f"data.max_response_length={NEW}",
        "rollout.vllm.cpu_kv_cache_gib=0.5", f"trainer.log_dir={tmp / 'logs'}",
        f"rollout.vllm.weights_dir={tmp / 'shm'}", "cluster.launcher=local", "actor.optim.lr=0.05",
        "cluster.actor.tensor_model_parallel_size=1", "cluster.ref.tensor_model_parallel_size=1"])
    tok = AutoTokenizer.from_pretrained(hf_dir)
    group = LocalWorkerGroup("actor", ActorWorker, dict(cfg=cfg, vocab_size=len(tok), total_steps=1), seed=1)
    try:
        yield group, tok, _gsm8k_prompt_ids(tok, N_PROMPTS), hf_dir
    finally:
        group.shutdown()
        disable_cpu_platform()


def _params(tok, **kw) -> SamplingParams:
    base = dict(max_response_length=NEW, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id or 0,
                seed=7)
    base.update(kw)
    return SamplingParams(**base)


def _teacher_forced(group, prompts, out, temperature: float) -> torch.Tensor:
    from megatron_ppo.data.batch import RolloutBatch

    mask = out.response_mask().float()
    batch = RolloutBatch(list(prompts), out.responses, mask)
    cfg = group.worker.cfg
    cfg.rollout.temperature = temperature  # the recompute divides by the rollout temperature, as the trainer does
    return group.call_rows("compute_log_probs", batch, batch.row_tokens())["log_probs"] * mask


def test_greedy_matches_the_megatron_engine_on_gsm8k(smollm2_actor):
    from transformers import AutoModelForCausalLM

    from megatron_ppo.rollout.megatron import MegatronEngine

    group, tok, prompts, hf_dir = smollm2_actor
    worker = group.worker
    params = _params(tok, greedy=True)
    got = worker.engine.generate(prompts, params)
    want = MegatronEngine.for_worker(worker).generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    identical, explained = 0, []
    for i in range(len(prompts)):
        a = got.responses[i, :got.response_lengths[i]].tolist()
        b = want.responses[i, :want.response_lengths[i]].tolist()
        if a == b:
            identical += 1
            continue
        j = next(k for k in range(min(len(a), len(b)) + 1) if k == min(len(a), len(b)) or a[k] != b[k])
        assert j < min(len(a), len(b)), f"row {i}: one response is a prefix of the other ({len(a)} vs {len(b)})"
        with torch.no_grad():  # HF's own logits at the divergence: the two picks must be a near tie
            logits = hf(torch.cat([prompts[i], torch.tensor(b[:j])]).unsqueeze(0)).logits[0, -1]
        gap = float(logits[b[j]] - logits[a[j]])
        explained.append((i, j, gap))
        assert abs(gap) < 1e-3, f"row {i}: vLLM took {a[j]}, Megatron {b[j]} at token {j}; HF logit gap {gap}"
    assert identical >= N_PROMPTS - 2, (identical, explained)
    # greedy log-probs: log_softmax(logits) of the chosen tokens, both engines
    same = [i for i in range(len(prompts)) if torch.equal(got.responses[i], want.responses[i])]
    diff = (got.log_probs[same] - want.log_probs[same]).abs().max()
    assert diff <= LOGPROB_TOL, diff
    print(f"greedy: {identical}/{N_PROMPTS} identical, divergences {explained}, log-prob max diff {float(diff):.2e}")


def test_sampled_log_probs_are_the_actors_teacher_forced_ones(smollm2_actor):
    group, tok, prompts, _ = smollm2_actor
    params = _params(tok, temperature=0.7)
    out = group.worker.engine.generate(prompts, params)
    assert int(out.response_lengths.sum()) > N_PROMPTS * 4
    recomputed = _teacher_forced(group, prompts, out, temperature=0.7)
    diff = (recomputed - out.log_probs * out.response_mask()).abs().max()
    assert diff <= LOGPROB_TOL, diff
    # the same seed gives the same responses (per-request seeds from SamplingParams.seed)
    again = group.worker.engine.generate(prompts, params)
    assert torch.equal(again.responses, out.responses)
    # eos handling as the Megatron engine's: eos counted in the length, pad after it, log-probs 0 after the end
    for i in range(len(prompts)):
        n = int(out.response_lengths[i])
        assert bool(out.finished[i]) == (out.responses[i, n - 1].item() == tok.eos_token_id)
        assert (out.log_probs[i, n:] == 0).all()


def test_a_batch_larger_than_one_prefill_step_samples_with_seeds(smollm2_actor):
    """64 GSM8K prompts (~7,700 prompt tokens, more than one engine step's budget) with seeded sampling: on CPU
    vLLM's chunked prefill would rewind a seeded generator and fail ("CPU Generator does not use offset"; found by
    tools/bench_generation.py at 64x128); whole-prompt prefill samples them, reproducibly."""
    group, tok, _, _ = smollm2_actor
    prompts = _gsm8k_prompt_ids(tok, 64)
    assert sum(p.numel() for p in prompts) > 4096
    params = _params(tok, temperature=1.0, max_response_length=3)
    first = group.worker.engine.generate(prompts, params)
    assert first.responses.shape == (64, 3)
    assert torch.equal(group.worker.engine.generate(prompts, params).responses, first.responses)


def test_an_update_is_refused_until_synced_then_followed(smollm2_actor):
    """Both hand-overs (rollout.vllm.weight_transport): safetensors files, then buckets shared with the engine's
    worker (shared memory here; CUDA IPC on a GPU), at the default bucket size and at one smaller than the
    embedding (many buckets, one of them a single tensor): the engine's log-probs are the updated actor's, and
    the rank never held more than one bucket."""
    from megatron_ppo.rollout.weights import StaleWeightsError

    group, tok, prompts, _ = smollm2_actor
    worker = group.worker
    params = _params(tok, temperature=1.0)
    for transport, bucket_mb in (("file", 512), ("ipc", 512), ("ipc", 16)):
        worker.engine.engine_cfg.weight_transport, worker.engine.engine_cfg.bucket_mb = transport, bucket_mb
        before = worker.engine.generate(prompts[:4], params)
        old = _teacher_forced(group, prompts[:4], before, 1.0)
        with torch.no_grad():  # a large step: every weight moves (as an update with a large learning rate would)
            gen = torch.Generator().manual_seed(0)
            for p in worker.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.abs().mean())
        worker.weights_version += 1  # what ActorWorker.update / load_checkpoint do
        with pytest.raises(StaleWeightsError, match=r"holds weights v\d+, the actor is at v\d+"):
            worker.engine.generate(prompts[:4], params)
        start = time.perf_counter()
        group.call_all("sync_weights")
        sync_s = time.perf_counter() - start
        after = worker.engine.generate(prompts[:4], params)
        new = _teacher_forced(group, prompts[:4], after, 1.0)
        mask = after.response_mask()
        assert (new - after.log_probs * mask).abs().max() <= LOGPROB_TOL, transport
        # ... and the old weights would not have given them: the update moved the log-probs by far more
        stale = (_teacher_forced(group, prompts[:4], before, 1.0) - old).abs().max()
        assert stale > 100 * LOGPROB_TOL, (transport, stale)
        if transport == "ipc":
            largest = max(p.numel() * p.element_size() for p in worker.model.parameters())
            assert 0 < worker.engine.peak_bucket_bytes <= max(bucket_mb << 20, largest)
            # nothing left on /dev/shm: the files the engine started from went at the first in-memory sync
            assert not [n for n in os.listdir(worker.engine.directory) if n.endswith(".safetensors")]
        print(f"{transport} {bucket_mb} MiB: sync {sync_s:.2f} s (export {worker.engine.export_seconds:.2f} s, "
              f"engine load {worker.engine.load_seconds:.2f} s); log-probs moved by {float(stale):.3f}")
    worker.engine.engine_cfg.weight_transport, worker.engine.engine_cfg.bucket_mb = "file", 512


def _engine_pid(worker) -> int:
    return worker.engine.process.pid


def test_a_hung_engine_is_killed_and_named(smollm2_actor):
    from megatron_ppo.distributed.group import WorkerGroupError

    group, tok, prompts, _ = smollm2_actor
    pid = _engine_pid(group.worker)
    group.worker.engine.engine_cfg.hang_timeout_s = 5
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerGroupError, match=r"vLLM engine of actor replica dp0 \(pid \d+\) hung: no answer "
                                                   r"to 'generate' for 5 s"):
            group.call_rows("generate", {"prompt_ids": prompts[:2]}, [10, 10], _params(tok), 1)
    finally:
        group.worker.engine.engine_cfg.hang_timeout_s = 30.0
    assert time.monotonic() - start < 5 + 15  # hang_timeout_s + polling and the kill
    assert wait_gone(pid)


def test_a_killed_engine_is_named_and_a_restart_is_not_silent(smollm2_actor, tmp_path):
    from megatron_ppo.distributed.group import WorkerGroupError

    group, tok, prompts, _ = smollm2_actor
    worker = group.worker
    # the previous test killed the engine: the replica has none; rebuild one on the current weights
    worker.engine.process = None
    worker.engine.version = None
    worker.engine.generate(prompts[:2], _params(tok))  # starts a fresh engine
    pid = _engine_pid(worker)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"vLLM engine of actor replica dp0 \(pid \d+\) (died|is not running)"):
        group.call_rows("generate", {"prompt_ids": prompts[:2]}, [10, 10], _params(tok), 1)
    assert time.monotonic() - start < 5
    assert wait_gone(pid)


def test_an_engine_that_cannot_start_is_an_error_naming_it(smollm2_actor):
    from megatron_ppo.rollout.vllm import EngineError

    group, tok, prompts, _ = smollm2_actor
    engine = group.worker.engine
    engine.process, engine.version = None, None
    engine.engine_cfg.python = sys.executable  # an interpreter without vLLM: the server dies at its first import
    try:
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"vLLM engine of actor replica dp0 \(pid \d+\) failed in 'start': "
                           r"ModuleNotFoundError: No module named 'vllm'"):
            engine.generate(prompts[:2], _params(tok))
        assert time.monotonic() - start < 30
        assert wait_gone(engine.process.pid)
    finally:
        engine.engine_cfg.python = str(vllm_python())
