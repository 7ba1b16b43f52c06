"""tools/gpu_check.sh, the device script of issue 23, on a CPU machine: it parses (a planted syntax error in a copy
is caught), its dry run runs every stage's CPU side and prints one summary line per stage and the count line, its
results become docs/bench/gpu.md through --record (the decode section pending until a run measured it), and the PPO
step's arithmetic (the 0.5 B model's parameter count against the planner, the MFU formula) is right."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ppo.testing import gpu_step

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
COUNT_LINE = re.compile(r"^gpu_check: (\d+) ok, (\d+) failed, (\d+) skipped in (\d+) s$")


def stages() -> list[str]:
    out = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    return [line.split("\t")[0] for line in out.splitlines()]


def check_script(path: Path) -> list[str]:
    """Problems bash -n (and shellcheck at warning level, where installed) finds in a copy of the script."""
    problems = []
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    if r.returncode:
        problems.append(f"bash -n: {r.stderr.strip()}")
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-S", "warning", str(path)], capture_output=True, text=True)
        if r.returncode:
            problems.append(f"shellcheck: {r.stdout.strip()[:2000]}")
    return problems


def test_the_script_parses_and_names_its_stages():
    assert check_script(SCRIPT) == []
    assert check_script(ROOT / "tools" / "gpu_check_prepare.sh") == []
    assert stages() == ["env", "deps", "build", "decode", "parity", "models", "sanitizer", "nccl", "ppo_step",
                        "bench", "vllm"]
    header = SCRIPT.read_text()[:4000]
    assert 'run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=600)' in header
    assert gpu_check_report().DECODE_CALL in header


def gpu_check_report():
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check_report as module

    return module


@pytest.mark.parametrize("only, needed", [("decode", False), ("env decode", False), ("decode parity", True),
                                          ("build", True), ("ppo_step", True), ("", False)])
def test_build_is_left_out_when_only_decode_is_selected(tmp_path, only, needed):
    """GPU_CHECK_ONLY=decode (issue 46's first call on a GPU): env, deps and decode, no build (decode needs none)."""
    copy = tmp_path / "gpu_check.sh"
    text = SCRIPT.read_text()
    assert text.rstrip().endswith('main "$@"')
    copy.write_text(text.rstrip()[:-len('main "$@"')])  # the functions only
    r = subprocess.run(["bash", "-c", f'source "{copy}"; ONLY="{only}"; build_needed && echo yes || echo no'],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.stdout.strip() == ("yes" if needed else "no"), r.stderr


@pytest.mark.parametrize("plant", [
    ("case $rc in", "case $rc"),                      # a case without 'in'
    ('    esac\n    fi\n', '    esac\n'),              # an unclosed if
    ('skip() {', 'skip() {{'),                        # an extra brace
])
def test_a_planted_syntax_error_is_caught(tmp_path, plant):
    old, new = plant
    text = SCRIPT.read_text()
    assert old in text, f"the planted bug's anchor {old!r} is gone: update the test"
    copy = tmp_path / "tools" / "gpu_check.sh"
    copy.parent.mkdir()
    copy.write_text(text.replace(old, new, 1))
    assert any(p.startswith("bash -n") for p in check_script(copy))
    r = subprocess.run(["bash", str(copy), "--dry-run"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "RESULTS_DIR": str(tmp_path / "results")})
    assert r.returncode != 0 and not any(COUNT_LINE.match(ln) for ln in r.stdout.splitlines())


@pytest.mark.slow
def test_dry_run_runs_every_stage_cpu_side_and_prints_the_summary(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=300,
                       env={"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                            "PYTHON": sys.executable, "RESULTS_DIR": str(tmp_path), "HOME": str(tmp_path)})
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    m = COUNT_LINE.match(lines[-1])
    assert m, lines[-5:]
    ok, failed, skipped, seconds = map(int, m.groups())
    names = stages()
    assert (ok + failed + skipped, failed) == (len(names), 0)
    assert ok >= 1 and seconds < 120  # measured 46 s at load average 8 on 2 cores; 42-55 s with stage decode (load 2)
    summary = lines[lines.index("gpu_check summary:") + 1:-1]
    assert [ln.split()[1] for ln in summary] == names
    for line, name in zip(summary, names):
        status = line.split(None, 2)[2]
        assert status.startswith(("ok", "skipped: ")), line
        if name not in ("env", "deps"):
            assert status.startswith("skipped: no GPU ("), line  # the CPU side ran, the GPU side did not
    results = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in results["stages"]] == names and results["dry_run"] is True
    assert results["ppo_step"]["actor_params"] == gpu_step.QWEN2_0P5B_PARAMS
    decode_line = summary[names.index("decode")]
    assert "skipped: no GPU (tools/bench_decode.py --dry-run timed the eager and static loops" in decode_line
    d = results["decode"]  # the bench's dry run really ran: both CPU systems timed, host reads counted
    assert d["dry_run"] is True and [c["case"] for c in d["cases"]] == ["4x8", "8x16"]
    for case in d["cases"]:
        assert case["systems"]["graphs"] == {"skipped": "no CUDA"}
        for name in ("eager", "static"):
            s = case["systems"][name]
            assert s["tokens_per_s"] > 0 and s["ms_per_step"] > 0 and s["every_row_made_its_tokens"], (name, s)
            assert s["host_reads_per_step"] is not None
        assert case["systems"]["eager"]["host_reads_per_step"] >= 1  # megatron's forward: a read every step
        assert case["systems"]["static"]["loop"] == "static"
    assert "| 8x16 | eager (at 8 tokens) |" in (tmp_path / "summary.md").read_text()
    assert {p.name for p in tmp_path.iterdir()} <= {"gpu_check.log", "summary.md", "results.json", "logs.tar.gz",
                                                     "ppo_step.json", "kernels_gpu.md", "engines.json",
                                                     "decode.json"}  # <= 8 files


def test_qwen2_0p5b_parameter_count_is_the_planners_and_the_published_one():
    from megatron_ppo.plan.memory import stage_params, total_params

    arch = gpu_step.arch()
    assert total_params(arch) == arch.num_parameters() == gpu_step.QWEN2_0P5B_PARAMS == 494_032_768
    assert stage_params(arch, "actor").total == total_params(arch)  # 151936 is already a multiple of 128
    assert gpu_step.params(arch, "critic") == total_params(arch) + arch.hidden_size  # + the value head row


def test_mfu_formula_and_step_flops():
    n, tokens, seconds, peak = 494_032_768, 18_000, 2.0, 989e12
    assert gpu_step.mfu(n, tokens, seconds, peak) == pytest.approx(6 * n * tokens / seconds / peak)
    assert gpu_step.mfu(n, tokens, seconds) == pytest.approx(0.026976, rel=1e-4)  # the H200 dense bf16 peak
    with pytest.raises(ValueError, match="must be positive"):
        gpu_step.mfu(n, tokens, 0.0)
    f = gpu_step.step_model_flops(n, n + 896, tokens, 64 * 256, actor_epochs=2)
    assert f["update_actor"] == 2 * 6 * n * tokens and f["update_critic"] == 6 * (n + 896) * tokens
    assert f["old_log_prob"] == 2 * n * tokens * 2 + 2 * (n + 896) * tokens  # actor + ref + values
    assert f["step"] == f["gen"] + f["old_log_prob"] + f["update_critic"] + f["update_actor"]


def test_ppo_step_config_is_local_cuda_bf16_with_the_0p5b_arch(tmp_path):
    from megatron_ppo.workers.build import model_arch, params_dtype

    cfg = gpu_step.build_config(tmp_path, steps=2, batch=32, response_length=128)
    assert (cfg.cluster.launcher, cfg.cluster.device) == ("local", "cuda")
    assert cfg.roles == ["actor", "critic", "ref"]
    assert {cfg.model_for(r).dtype for r in cfg.roles} == {"bfloat16"}
    assert {str(params_dtype(cfg, r)) for r in cfg.roles} == {"torch.bfloat16"}
    for role in cfg.roles:
        assert model_arch(cfg, role, 151936) == gpu_step.arch()
    assert (cfg.data.train_batch_size, cfg.data.max_response_length, cfg.trainer.total_training_steps) == (32, 128, 2)
    assert cfg.trainer.val_before_train is False and cfg.trainer.save_freq == -1


def test_tokenizer_has_the_models_vocabulary_and_decodes_every_id(tmp_path):
    from megatron_ppo.data.tokenizer import load_tokenizer

    path = gpu_step.make_tokenizer(tmp_path / "tok", 1000, ["What is 3 + 4? Answer after ####."])
    tok = load_tokenizer(path)
    assert len(tok) == 1000 and tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.unk_token_id not in ids[1:]  # the prompt's words are in the vocabulary
    assert isinstance(tok.decode(list(range(1000))), str)


@pytest.mark.slow
def test_ppo_step_rehearsal_on_cpu(tmp_path):
    """The step's whole path (inputs, config, components, PPOTrainer.fit, summary) with a tiny model on the CPU."""
    from megatron_ppo.parallel.platform import disable_cpu_platform

    try:
        result = gpu_step.run(tmp_path, arch_name="tiny", device="cpu", steps=2, batch=4, response_length=8,
                              micro_batch=2, dtype="float32", micro_tokens=160)
    finally:
        disable_cpu_platform()  # later tests in this process run without the CUDA->CPU remap
    assert result["steps_measured"] == 1 and result["warmup_steps_excluded"] == 1
    assert result["tokens_per_step"] > 4 * 8 and result["step_s"] > 0
    assert result["mfu_6nt_step"] == pytest.approx(gpu_step.mfu(result["actor_params"], result["tokens_per_step"],
                                                                result["step_s"]))
    assert {"gen", "old_log_prob", "update_critic", "update_actor"} <= set(result["timing_s"])
    calls = result["worker_calls"]  # the measured step's device-side calls, every role, by a 160-token budget
    assert set(calls["by_role"]) == {"actor", "critic", "ref"} and calls["micro_batches"] >= 3
    assert 0 < calls["reads_per_micro_batch"] <= 8, (calls, result["host_reads_by_call"])


def nccl_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_nccl_world", ROOT / "tools" / "gpu_nccl_world.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nccl_refusal_is_told_from_a_failure():
    tool = nccl_tool()
    refusal = ("RankFailedError: LocalWorkerPool: rank 0 raised while running _collectives\n"
               "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690, invalid usage (run "
               "with NCCL_DEBUG=WARN for details), NCCL version 2.27.7\nncclInvalidUsage: This usually reflects "
               "invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 0 and rank 1 both on "
               "CUDA device 9d000")
    status, reason = tool.classify(refusal)
    assert status == "refused" and reason.endswith("Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 9d000")
    assert tool.classify("TimeoutError: LocalWorkerPool: ranks [1] gave no answer within 30 s") == ("failed", None)


@pytest.mark.slow
def test_nccl_script_world_of_two_on_gloo(tmp_path):
    """The device stage's path (LocalWorkerPool of 2, both jobs, the result checks) on the CPU's gloo backend."""
    out_file = tmp_path / "nccl.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_nccl_world.py"), "--allow-cpu", "--timeout", "120",
                        "--out", str(out_file)], capture_output=True, text=True, timeout=300)
    out = json.loads(out_file.read_text())
    assert r.returncode == 0 and out["status"] == "ok", (out.get("error"), r.stderr[-3000:])
    assert [r["all_reduce"] for r in out["collectives"]] == [[3.0] * 4] * 2
    assert all(r["max_abs_diff"] < 1e-5 for r in out["vocab_parallel_logprobs"])


def fake_device_results(tmp_path: Path) -> Path:
    """What a device run brings back, written by the report's own summarize from made-up stage results."""
    work, res = tmp_path / "work", tmp_path / "res"
    (work / "logs").mkdir(parents=True)
    res.mkdir()
    rows = [("env", "ok", 4, 30), ("deps", "ok", 3, 40), ("build", "ok", 71, 180), ("parity", "ok", 52, 100),
            ("models", "ok", 31, 75), ("sanitizer", "FAILED (exit 1)", 60, 90),
            ("nccl", "skipped: NCCL refuses two ranks of one communicator on one GPU: Duplicate GPU detected", 12, 45),
            ("ppo_step", "ok", 88, 150), ("bench", "timed out after 39s", 39, 39),
            ("vllm", "skipped: vLLM is not installed in the image's Python (no network here)", 1, 360)]
    (work / "stages.tsv").write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    (work / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "python": "3.12.3",
                                               "megatron_core": "0.16.1", "transformer_engine": "not installed"}))
    (work / "logs" / "parity.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="10" failures="1" errors="0" skipped="2">'
        '<testcase classname="tests.unit.test_ops_logprob" name="test_x[cuda]"><failure message="m"/></testcase>'
        '</testsuite></testsuites>')
    (work / "logs" / "sanitizer_memcheck.log").write_text("========= ERROR SUMMARY: 2 errors\n")
    (work / "nccl.json").write_text(json.dumps({"status": "refused", "nccl_version": "2.27.7",
                                                "reason": "NCCL refuses ...: Duplicate GPU detected"}))
    history = {"timing/step": 3.0, "timing/gen": 2.0, "timing/update_actor": 0.4, "perf/total_num_tokens": 18000.0,
               "response_length/mean": 256.0}
    cfg = gpu_step.build_config(tmp_path / "cfg", steps=3)
    p = gpu_step.summarize([history] * 3, 494_032_768, 494_033_664, cfg, gpu_step.H200_BF16_PEAK_FLOPS)
    p.update(arch="qwen2-0.5b", actor_params=494_032_768, critic_params=494_033_664, dtype="bfloat16",
             transformer_impl="local", ops_backend="cuda", device="NVIDIA H200", torch="2.11.0+cu130", batch=64,
             response_length=256, micro_batch=16, steps=3, build_s=20.0, max_memory_allocated_gib=40.0)
    (res / "ppo_step.json").write_text(json.dumps(p))
    (res / "kernels_gpu.md").write_text("### GAE on cuda\n\n| method | ms |\n|---|---:|\n| kernel | 0.1 |\n")
    subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check_report.py"), "summarize", "--work", str(work),
                    "--results", str(res), "--elapsed", "420", "--budget", "480", "--dry-run", "0"], check=True,
                   capture_output=True)
    return res


def test_record_writes_the_gpu_page_from_a_device_run(tmp_path):
    res = fake_device_results(tmp_path)
    results = json.loads((res / "results.json").read_text())
    assert results["counts"] == {"ok": 6, "skipped": 2, "failed": 2}
    assert results["parity"]["failed_tests"] == ["tests.unit.test_ops_logprob::test_x[cuda]"]
    kernels_page = tmp_path / "kernels.md"
    kernels_page.write_text("# Kernels\n\n<!-- gpu-results: tools/gpu_check.sh replaces everything below this line "
                            "-->\n\n## GPU: pending\n")
    page = tmp_path / "gpu.md"
    r = subprocess.run(["bash", str(SCRIPT), "--record", str(res), "--out", str(page), "--kernels-page",
                        str(kernels_page)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                                  "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout + r.stderr
    text = page.read_text()
    assert "`gpu_check: 6 ok, 2 failed, 2 skipped in 420 s`" in text
    for name in stages():
        assert f"| {name} |" in text
    assert "**timed out after 39s**" in text and "Duplicate GPU detected" in text and "ERROR SUMMARY: 2 errors" in text
    assert "| 3.00 | 2.00 |" in text and "MFU against a peak of 989 TFLOP/s" in text
    mfu = 6 * 494_032_768 * 18000 / 3.0 / 989e12
    assert f"{mfu:.2%}" in text
    assert "kernel | 0.1" in kernels_page.read_text() and "pending" not in kernels_page.read_text()
    pending = text[text.index("## Decode step (issue 46)"):]  # no decode.json came back: the section says pending
    assert "Pending (no GPU lent)" in pending and gpu_check_report().DECODE_CALL in pending
    assert "bash tools/gpu_check_prepare.sh" in pending and ">= 20,000 tokens/s at 64" in pending
    update = text[text.index("## The Megatron update on a GPU (issue 47)"):]  # a ppo_step without host-read counts
    assert "Pending (no GPU lent)" in update and gpu_check_report().UPDATE_CALL in update


def fake_decode() -> dict:
    """A decode.json as tools/bench_decode.py writes it on a GPU (made-up numbers)."""
    import bench_decode as bd

    base = {"loop": "static", "new_tokens_run": 256, "capped": False, "wall_s": 0.7, "wall_s_all": [0.7],
            "prefill_s": 0.06, "every_row_made_its_tokens": True, "host_reads": {"aten::item": 4},
            "host_reads_per_step": 0.125, "profile_new_tokens": 33}
    systems = {"eager": dict(base, loop="megatron forward", new_tokens_run=64, capped=True, wall_s=3.3, prefill_s=0.1,
                             host_reads_per_step=3.0),
               "static": dict(base, wall_s=2.0), "graphs": dict(base)}
    for s in systems.values():
        s.update(bd.derive(64, s["new_tokens_run"], s["wall_s"], s["prefill_s"], 0.295))
    systems["eager"]["tokens_per_s_full_est"] = 1300.0
    cases = [{"case": "64x256", "prompts": 64, "new": 256, "prompt_width": 128, "floor_with_kv_ms": 0.39,
              "systems": systems}]
    return {"tool": "tools/bench_decode.py", "command": "python tools/bench_decode.py --out decode.json",
            "dry_run": False, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "arch": "qwen2-0.5b",
            "params": 494_032_768, "dtype": "bfloat16", "transformer_impl": "local", "param_bytes": 988_065_536,
            "bandwidth_gbs": 3350.0, "floor_ms": 0.295, "prompt_len": [64, 128], "profile_steps": 32,
            "build_s": 5.0, "elapsed_s": 60.0, "cases": cases, "goals": bd.goal_results(cases)}


def test_record_shows_a_device_runs_decode_table(tmp_path):
    res = fake_device_results(tmp_path)
    (res / "decode.json").write_text(json.dumps(fake_decode()))  # brought back beside results.json
    page = tmp_path / "gpu.md"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check_report.py"), "record", str(res), "--out",
                    str(page), "--kernels-page", ""], check=True, capture_output=True, text=True)
    text = page.read_text()
    decode = text.split("## The Megatron update on a GPU (issue 47)")[0]
    assert "Pending (no GPU lent)" not in decode and "## Decode step (stage decode, issue 46)" in text
    assert "| 64x256 | eager (at 64 tokens) |" in text and "| 64x256 | graphs | 23406 |" in text
    assert "goal ms per decode step at 64 rows <= 3: 2.51 (graphs), met" in text


def test_record_shows_issue_47s_update_measurements(tmp_path):
    res = fake_device_results(tmp_path)
    p = json.loads((res / "ppo_step.json").read_text())
    p.update(micro_tokens=16384, worker_calls={
        "reads": 40, "micro_batches": 10, "reads_per_micro_batch": 4.0,
        "by_role": {"actor": {"reads": 30, "micro_batches": 6}, "critic": {"reads": 10, "micro_batches": 4}},
        "peak_gib_by_role": {"actor": 31.5, "critic": 20.25}, "transient_gib_by_role": {"actor": 9.0}})
    p["qwen2-1.5b"] = dict(p, arch="qwen2-1.5b")
    p["thd_attention"] = [{"shape": "qwen2.5-0.5b", "tokens": 16384, "strategies": {
        "varlen": {"ms": 41.25, "tokens_per_s": 397188.0}, "flex": {"ms": 48.0, "tokens_per_s": 341333.0},
        "block_mask": None}}]
    (res / "ppo_step.json").write_text(json.dumps(p))
    results = json.loads((res / "results.json").read_text())
    results["ppo_step"] = p  # summarize copies ppo_step.json into results.json on the device
    (res / "results.json").write_text(json.dumps(results))
    page = tmp_path / "gpu.md"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check_report.py"), "record", str(res), "--out",
                    str(page), "--kernels-page", ""], check=True, capture_output=True, text=True)
    text = page.read_text()
    assert "## The Megatron update on a GPU (issue 47)" not in text  # measured: no pending section
    assert "micro-batches by a 16384-token budget" in text and "| actor | 6 | 30 | 31.5 | 9.0 |" in text
    assert "4.0 per micro-batch (issue 47's budget: 8)" in text and "### The 1.5 B shape" in text
    assert "| qwen2.5-0.5b | 16384 | varlen | 41.2 | 397188 |" in text and "block_mask |" not in text


def test_record_refuses_a_dry_run(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"dry_run": True}))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check_report.py"), "record", str(tmp_path),
                        "--out", str(tmp_path / "gpu.md")], capture_output=True, text=True)
    assert r.returncode != 0 and "dry run" in r.stderr and not (tmp_path / "gpu.md").exists()


def test_the_gpu_page_names_every_stage():
    text = (ROOT / "docs" / "bench" / "gpu.md").read_text()
    assert "Never run" in text or "Run finished" in text
    for name in stages():
        assert f"| {name} |" in text


def test_engines_compares_the_two_engines_generation(tmp_path):
    """Stage vllm: the two engines' gpu_step results -> engines.json with the ratio issue 25's goal reads, and the
    summary's table."""
    cfg = gpu_step.build_config(tmp_path / "cfg", steps=2)
    paths = {}
    for engine, gen in (("megatron", 8.0), ("vllm", 2.0)):
        history = {"timing/step": gen + 4.0, "timing/gen": gen, "timing/sync_weights": 0.5 if engine == "vllm" else
                   0.0, "timing/update_actor": 1.0, "perf/total_num_tokens": 256 * 552.0, "response_length/mean": 512.0}
        p = gpu_step.summarize([history] * 2, 494_032_768, 494_033_664, cfg, gpu_step.H200_BF16_PEAK_FLOPS)
        p.update(arch="qwen2-0.5b", dtype="bfloat16", batch=256, response_length=512, engine=engine)
        paths[engine] = tmp_path / f"{engine}.json"
        paths[engine].write_text(json.dumps(p))
    out = tmp_path / "engines.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check_report.py"), "engines", str(paths["megatron"]),
                        str(paths["vllm"]), "--out", str(out)], capture_output=True, text=True, check=True)
    e = json.loads(out.read_text())
    assert e["vllm_over_megatron_gen"] == pytest.approx(4.0)  # same tokens, a quarter of the time
    assert "4.00x (goal >= 3x)" in r.stdout
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check_report

    text = "\n".join(gpu_check_report.engine_lines(e))
    assert "| vllm | " in text and "**4.00x**" in text


def test_record_appends_the_notes_and_a_rerun_after_fixes(tmp_path):
    """A lease's second call (GPU_CHECK_ONLY=..., after fixing what the first found) is recorded on the same page,
    after the first run and the findings, with its own counts; a dry run's results are refused as a rerun."""
    first = fake_device_results(tmp_path / "first")
    rerun = fake_device_results(tmp_path / "rerun")
    r2 = json.loads((rerun / "results.json").read_text())
    r2["counts"], r2["finished_utc"] = {"ok": 5, "failed": 0, "skipped": 5}, "2026-12-04T16:06:52+00:00"
    (rerun / "results.json").write_text(json.dumps(r2))
    notes = tmp_path / "notes.md"
    notes.write_text("## What the first run found\n\nA planted finding.\n")
    page = tmp_path / "gpu.md"
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check_report.py"), "record", str(first), "--out", str(page),
           "--kernels-page", "", "--notes", str(notes), "--rerun", str(rerun)]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = page.read_text()
    first_at, notes_at = text.index("`gpu_check: 6 ok, 2 failed"), text.index("A planted finding.")
    rerun_at = text.index("## Rerun, finished 2026-12-04T16:06:52+00:00")
    assert first_at < notes_at < rerun_at and "`gpu_check: 5 ok, 0 failed, 5 skipped" in text[rerun_at:]
    r2["dry_run"] = True
    (rerun / "results.json").write_text(json.dumps(r2))
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode != 0 and "dry run" in bad.stderr
