"""The vLLM engine's plumbing without vLLM: the real server script (vllm_process/mppo_vllm_server.py, which imports
vLLM only to start an engine) driven by the real EngineProcess: answers, a hung process (SIGSTOP) killed and named
within the timeout, a killed one named at once, a server that outlives its rank's death does not exist; the answer
-> GenerationOutput conversion; the config checks and the preflight naming `make setup-vllm`; the HF config of an
architecture (the inverse of the converter's reading of one)."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megatron_ppo.config import load_config
from megatron_ppo.config.io import ConfigError
from megatron_ppo.rollout import SamplingParams
from megatron_ppo.rollout.vllm import EngineError, EngineProcess, logprobs_mode, to_output
from megatron_ppo.testing.processes import wait_gone


@pytest.fixture
def server(tmp_path):
    proc = EngineProcess(sys.executable, "vLLM engine of actor replica dp3", str(tmp_path / "engine.log"),
                         dict(os.environ), start_timeout_s=30, hang_timeout_s=2)
    yield proc
    proc.kill()


def test_the_server_answers_and_exits_when_asked(server):
    reply = server.call({"op": "ping"}, 30)
    assert reply["ok"] and reply["pid"] == server.pid and reply["version"] == -1
    with pytest.raises(EngineError, match=r"dp3 \(pid \d+\) failed in 'generate': RuntimeError: stale weights"):
        server.call({"op": "generate", "version": 5, "prompts": [], "sampling": {}, "call": 1,
                     "heartbeat_s": 1}, 30)
    assert wait_gone(server.pid)  # a failed engine is not reused


@pytest.mark.parametrize("sig, timeout, says, within", [
    (signal.SIGSTOP, 2, r"hung: no answer to 'ping' for 2 s", 2 + 8),  # the timeout, then the kill (busy machine)
    (signal.SIGKILL, 30, r"(died during 'ping'|is not running) \(exit code -9, signal SIGKILL\)", 8),  # at once
])
def test_a_hung_or_killed_server_is_named_and_gone(server, sig, timeout, says, within):
    server.call({"op": "ping"}, 30)
    os.kill(server.pid, sig)
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"vLLM engine of actor replica dp3 \(pid \d+\) " + says):
        server.call({"op": "ping"}, timeout)
    assert time.monotonic() - start < within
    assert wait_gone(server.pid)


def test_the_server_ends_with_its_rank(tmp_path):
    """A rank that dies without a word (kill -9): its engine notices (closed socket / new parent) and exits."""
    script = textwrap.dedent(f"""
        import os, sys
        from megatron_ppo.rollout.vllm import EngineProcess
        p = EngineProcess(sys.executable, "e", {str(tmp_path / 'log')!r}, dict(os.environ), 30, 30)
        p.call({{"op": "ping"}}, 30)
        print(p.pid, flush=True)
        os._exit(0)  # no atexit, no close: as a killed rank
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    assert wait_gone(pid, timeout=10)


def test_answers_become_what_the_megatron_engine_returns():
    params = SamplingParams(max_response_length=4, eos_token_ids=(2, 9), pad_token_id=0)
    out = to_output([{"token_ids": [5, 6, 2], "log_probs": [-0.5, -1.0, -0.25]},
                     {"token_ids": [7, 7, 7, 7], "log_probs": [-1.0] * 4},
                     {"token_ids": [9], "log_probs": [-2.0]}], params)
    assert out.responses.tolist() == [[5, 6, 2, 0], [7, 7, 7, 7], [9, 0, 0, 0]]
    assert out.response_lengths.tolist() == [3, 4, 1]
    assert out.finished.tolist() == [True, False, True]
    assert out.log_probs.tolist() == [[-0.5, -1.0, -0.25, 0.0], [-1.0] * 4, [-2.0, 0.0, 0.0, 0.0]]
    with pytest.raises(EngineError, match="5 tokens, 5 log-probs, max 4"):
        to_output([{"token_ids": [1] * 5, "log_probs": [0.0] * 5}], params)
    with pytest.raises(EngineError, match="2 tokens, 1 log-probs"):
        to_output([{"token_ids": [1, 2], "log_probs": [0.0]}], params)


def test_log_prob_mode_follows_the_sampling_sections():
    plain = load_config("tiny_cpu", ["rollout.name=vllm"])
    assert logprobs_mode(plain) == "processed_logprobs"  # log_softmax(logits / T): temperature, no truncation
    topk = load_config("tiny_cpu", ["rollout.name=vllm", "rollout.top_k=20", "rollout.temperature=1.0"])
    assert logprobs_mode(topk) == "raw_logprobs"  # T = 1: the raw log-probs are the trainer's


@pytest.mark.parametrize("override, key", [
    (["rollout.top_k=20", "rollout.temperature=0.7"], "rollout.temperature"),
    (["rollout.top_p=0.9", "rollout.temperature=0.7"], "rollout.temperature"),
    (["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.top_k=5", "rollout.val_kwargs.temperature=0.5"],
     "rollout.val_kwargs.temperature"),
    (["rollout.vllm.gpu_memory_utilization=1.5"], "rollout.vllm.gpu_memory_utilization"),
    (["rollout.vllm.cpu_kv_cache_gib=0"], "rollout.vllm.cpu_kv_cache_gib"),
    (["rollout.vllm.tensor_model_parallel_size=0"], "rollout.vllm.tensor_model_parallel_size"),
    (["rollout.vllm.hang_timeout_s=0"], "rollout.vllm.hang_timeout_s"),
])
def test_vllm_settings_are_checked_by_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny_cpu", ["rollout.name=vllm"] + override)
    load_config("tiny_cpu", override if "temperature" in key else [])  # the megatron engine takes them


def test_a_missing_vllm_venv_is_a_preflight_error_naming_the_setup(tmp_path):
    from megatron_ppo.trainer.preflight import PreflightError, run_preflight

    for python, says in ((tmp_path / "nope" / "python", "no vLLM virtualenv interpreter at"),
                         (sys.executable, "has no vllm package")):
        cfg = load_config("tiny_cpu", ["rollout.name=vllm", f"rollout.vllm.python={python}",
                                       f"trainer.log_dir={tmp_path}/logs"])
        with pytest.raises(PreflightError, match=f"rollout.name=vllm: .*{says}.*`make setup-vllm`"):
            run_preflight(cfg)


@pytest.mark.parametrize("arch_kw", [
    dict(tie_word_embeddings=True),
    dict(add_qkv_bias=True, kv_channels=32),
    dict(rotary_base=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
])
def test_hf_config_of_an_arch_reads_back_as_that_arch(arch_kw):
    from megatron_ppo.convert.mapping import arch_from_hf_config, hf_config_dict
    from megatron_ppo.models.arch import ModelArch

    arch = ModelArch(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                     vocab_size=300, max_position_embeddings=512, norm_epsilon=1e-5, **arch_kw)
    d = hf_config_dict(arch)
    assert d["model_type"] == ("qwen2" if arch.add_qkv_bias else "llama")
    back = dataclasses.asdict(arch_from_hf_config(d))
    want = dataclasses.asdict(arch)
    back.pop("extra"), want.pop("extra")
    assert back == want


def test_hf_config_refuses_what_no_hf_model_is():
    from megatron_ppo.convert.mapping import ConversionError, hf_config_dict
    from megatron_ppo.models.arch import ModelArch

    arch = ModelArch(2, 64, 96, 4, 2, 300, 512, add_qkv_bias=True, extra={"hf_model_type": "llama"})
    with pytest.raises(ConversionError, match="no HF model type"):
        hf_config_dict(arch)


def test_a_sent_message_is_answered_when_received_later_and_the_bound_server_runs_on_its_cores(tmp_path):
    """send / receive (what submit / collect of trainer.async_rollout=one_step use): the answer waits in the socket
    until it is read. rollout.vllm.cpu_threads_bind: the whole server process runs on the listed cores, not only
    vLLM's OMP threads (the engine loop on the training's cores slowed the training by half: tools/bench_async.py)."""
    import psutil

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    proc = EngineProcess(sys.executable, "vLLM engine of actor replica dp0", str(tmp_path / "engine.log"), env,
                         start_timeout_s=30, hang_timeout_s=5)
    try:
        msg = {"op": "ping"}
        proc.send(msg)
        time.sleep(0.5)  # the rank does something else meanwhile
        assert proc.receive(msg, 30)["ok"]
        assert psutil.Process(proc.pid).cpu_affinity() == [0]
    finally:
        proc.close()


def test_a_weight_hand_over_the_engine_refuses_is_named_at_once(server, tmp_path):
    """weight_transport=ipc: the owner waits for the engine's workers to connect; an engine whose load fails
    before any worker connects (here: no engine was started) answers with its error, and the owner raises it
    naming the engine within a poll, not after start_timeout_s."""
    from megatron_ppo.rollout.vllm_channel import BucketChannel

    channel = BucketChannel(str(tmp_path), 1, server, timeout_s=30)
    server.send({"op": "load_buckets", "address": channel.address, "authkey": channel.authkey, "version": 1,
                 "tie": False})
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"dp3 \(pid \d+\) failed in 'load_buckets': AttributeError"):
        channel.send(torch.zeros(8, dtype=torch.uint8), {"names": [], "shapes": [], "dtypes": [], "offsets": [],
                                                          "nbytes": [], "used": 0})
    assert time.monotonic() - start < 5
    assert not os.path.exists(channel.address)
    assert wait_gone(server.pid)


def test_a_replica_with_an_engine_per_node_answers_in_prompt_order():
    """ppo_70b's replicas have 4 engines each: engine i generated rows_of(n, i, 4); the representative's gather
    (one entry per rank of the replica, None where a rank owns no engine) comes back in prompt order, and a missing
    engine is an error, not a silently shorter batch."""
    from megatron_ppo.rollout.vllm import merge_shares
    from megatron_ppo.rollout.vllm_layout import rows_of

    rows = list(range(10))
    shares = [(None, None)] * 32
    for i in (2, 0, 3, 1):  # ranks report in rank order, not engine order
        shares[8 * i + (i % 2)] = (i, rows[rows_of(10, i, 4)])
    assert merge_shares(shares) == rows
    shares[0] = (None, None)
    with pytest.raises(EngineError, match=r"answers from engines \[1, 2, 3\], expected 0..2"):
        merge_shares(shares)
