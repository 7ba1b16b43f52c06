"""The SmolLM2 learning page is built from run records kept beside it (a run is an hour of 2 cores, so seeds come
from different passes): a record carries what the table shows, and a page lists every kept seed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_learning_smollm2 as bench  # noqa: E402


def _eval(acc: float, length: float) -> dict:
    return {"accuracy": acc, "accuracy_ci95": [acc - 0.05, acc + 0.05], "format_rate": 1.0,
            "mean_response_length": length, "n": 256, "seconds": 60.0}


def _run_dir(work: Path, name: str, rewards: list[float]) -> None:
    logs = work / name / "logs"
    logs.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "reward/score/mean": r, "actor/ppo_kl_k3": 0.001 * (i + 1),
                         "critic/vf_explained_var": 0.5 - 100 * i, "response_length/clip_ratio": 0.5 * (i % 2)})
             for i, r in enumerate(rewards)]
    (logs / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_records_of_two_passes_make_one_table_with_every_seed(tmp_path):
    work, page_dir = tmp_path / "work", tmp_path / "page"
    _run_dir(work, "arith_s2", [0.1] * 4 + [0.3] * 8 + [0.5] * 4)
    _run_dir(work, "arith_s1", [0.2] * 16)
    base = {**_eval(0.2, 69.0), "strict_format_rate": 0.1}
    bench.save_record(page_dir, bench.run_record(work, "arith_s2", 2, base, {**_eval(0.45, 12.0),
                                                                             "strict_format_rate": 0.2}, 3000.0, 16,
                                                 {"1-digit + 1-digit": [9, 16]}, {"1-digit + 1-digit": [3, 16]}))
    earlier = bench.run_record(work, "arith_s1", 1, base, _eval(0.4, 11.0), 2900.0, 16)
    earlier["source"] = "reconstructed from an older page"
    bench.save_record(page_dir, earlier)

    runs = bench.load_records(page_dir, "arith_s")
    assert [r["seed"] for r in runs] == [1, 2]
    assert runs[1]["reward_ends"] == [0.1, 0.5]  # first and last quarter of 16 steps: 4 values each
    lines = bench.task_section("Arithmetic", runs, page_dir, "the goal")
    rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    assert "0.200 -> 0.450 [0.400, 0.500] | +25.0 pts" in rows[1] and "0.100 -> 0.500" in rows[1]
    assert "| 69 -> 12 |" in rows[1] and "| 16 | 50.0 |" in rows[1]
    assert "1.000 -> 1.000 (####: 0.100 -> 0.200) |" in rows[1]  # GSM8K's own format, where the evals have it
    assert "Seed 1: reconstructed from an older page." in lines
    assert runs[1]["critic_explained_var"] == {"min": 0.5 - 1500, "median": 0.5 - 750, "max": 0.5}
    assert ("Seed 2: the critic's explained variance (critic/vf_explained_var, every step) had median -749.500, "
            "range [-1.5e+03, 0.5]; sampled responses clipped at the length limit 0.250 -> 0.250 (first -> last "
            "quarter).") in lines
    assert not any("machine peaked" in line for line in lines)  # no memory.csv in these run dirs
    table = bench.kind_table([("base", runs[1]["base_kinds"]), ("seed 2", runs[1]["kinds"])])
    assert "| 1-digit + 1-digit | 3/16 | 9/16 |" in table


def test_the_kept_seed_1_record_matches_its_per_kind_counts():
    """docs/bench/learning_smollm2/arith_s1.json was rebuilt from the page by hand: its counts must add up."""
    page_dir = Path(__file__).resolve().parents[2] / "docs" / "bench" / "learning_smollm2"
    r = json.loads((page_dir / "arith_s1.json").read_text())
    for key, kinds in (("after", r["kinds"]), ("base", r["base_kinds"])):
        assert sum(n for _, n in kinds.values()) == r[key]["n"]
        assert abs(sum(c for c, _ in kinds.values()) / r[key]["n"] - r[key]["accuracy"]) < 1e-3


def test_every_run_setting_is_a_valid_override_of_the_recipe(tmp_path):
    """A misspelt key or a refused combination fails here, not an hour into a benchmark."""
    from megatron_ppo.config import load_config

    for overrides in (bench.ARITH_TRAIN, bench.GSM8K_TRAIN, bench.ARITH_LR, bench.ARITH_HOLD):
        cfg = load_config("smollm2_gsm8k", list(overrides))
        assert cfg.rollout.n == 4 and cfg.rollout.temperature == 0.7
    for overrides in (bench.ARITH_LR, bench.ARITH_HOLD):
        cfg = load_config("smollm2_gsm8k", list(overrides))
        assert cfg.trainer.save_best and cfg.trainer.test_freq == 5 and cfg.actor.optim.lr == 1e-5
    hold = load_config("smollm2_gsm8k", [*bench.CKPT_KEEP, *bench.ARITH_HOLD])
    assert hold.actor.kl_loss_coef == 0.05 and hold.data.val_max_samples == bench.ARITH_VAL
    assert hold.trainer.max_actor_ckpt_to_keep == hold.trainer.max_critic_ckpt_to_keep == 1  # the newest and the best
    for overrides in (bench.GSM8K_TRAIN, bench.GSM8K_EVAL):  # a "#..." override was once read as a YAML comment
        assert load_config("smollm2_gsm8k", list(overrides)).rollout.stop_pattern == r"####[^\n]*\n"
    offline = [*bench.OFFLINE_TRAIN, "rollout.mode=offline", f"rollout.trajectory_files=[{tmp_path}]",
               "data.train_files=[]"]
    for _, extra in bench.OFFLINE:
        cfg = load_config("smollm2_gsm8k", [*offline, *extra])
        assert cfg.rollout.n == 1 and cfg.data.train_batch_size == 32


def test_reuse_keeps_only_a_dir_made_by_the_same_command(tmp_path):
    """--reuse once kept session 17's base eval for a pass whose evals add rollout.stop_pattern."""
    args = ["eval", "--model", "m", *bench.GSM8K_EVAL]
    assert not bench.same_command(tmp_path, args)  # made by an older tool: no command.json
    (tmp_path / "command.json").write_text(json.dumps(args))
    assert bench.same_command(tmp_path, args)
    assert not bench.same_command(tmp_path, args[:-1])


def test_strict_accuracy_rescores_the_samples_by_verls_rule(tmp_path):
    """The GSM8K evals score with the numeric rule; the page's strict (verl) accuracy is rescored from the same
    responses: only a right "#### N" counts."""
    out = tmp_path / "eval_x"
    out.mkdir()
    rows = [("so 18 eggs\n#### 18", "18"), ("the answer is 18", "18"), ("#### 17", "18"), ("#### 1,234", "1234")]
    out.joinpath("samples.jsonl").write_text("".join(json.dumps({"response": r, "ground_truth": g}) + "\n"
                                                     for r, g in rows))
    got = bench.strict_accuracy(tmp_path, "x")
    assert got["n"] == 4 and got["accuracy"] == 0.5  # rows 0 and 3; row 1 has no "####", row 2 is wrong
    lo, hi = got["accuracy_ci95"]
    assert lo < 0.5 < hi


def test_a_runs_memory_samples_give_its_records_peak(tmp_path):
    work, page_dir = tmp_path / "work", tmp_path / "page"
    _run_dir(work, "gsm8k_s1", [0.1] * 8)
    (work / "gsm8k_s1" / "memory.csv").write_text("seconds,used_gib,available_gib\n0.0,5.0,17.0\n2.0,18.51,3.5\n"
                                                  "4.0,9.0,13.0\n")
    base = {**_eval(0.03, 207.0), "strict_format_rate": 0.1}
    bench.save_record(page_dir, bench.run_record(work, "gsm8k_s1", 1, base, base, 2700.0, 20))
    runs = bench.load_records(page_dir, "gsm8k_s")
    assert runs[0]["machine_peak_gib"] == 18.51
    assert ("Seed 1: the machine peaked at 18.5 GiB used (total - available) while it trained "
            "(tools/sample_memory.py, every 2 s).") in bench.task_section("GSM8K", runs, page_dir, "goal")


def test_stopping_the_tool_stops_its_training_child(tmp_path):
    """A training child outliving a stopped tool holds ~19 GiB and starved the next run (session 17): SIGTERM to the
    tool must take its child down too."""
    import os
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    tool = ("import sys; sys.path.insert(0, {tools!r}); import bench_learning_smollm2 as b; b.exit_on_sigterm(); "
            "b.run_child([sys.executable, '-c', {child!r}], __import__('pathlib').Path({log!r}), {{}}, grace_s=10)"
            ).format(tools=str(Path(bench.__file__).parent), child=child, log=str(tmp_path / "child.log"))
    parent = subprocess.Popen([sys.executable, "-c", tool])
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
        time.sleep(0.1)
    child_pid = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(30) == 128 + signal.SIGTERM
    try:
        os.kill(child_pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, f"child {child_pid} outlived the tool"


def test_the_check_slice_is_the_rows_after_the_subset_and_its_line_counts_right_answers(tmp_path):
    """--gsm8k-check scores questions 257-512, on which no setting was chosen: the slice must be exactly those rows
    (not the first 256 again), and the page line must say base -> after for each seed that has it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "test.parquet"
    pq.write_table(pa.table({"row_id": list(range(600))}), src)
    dst = bench.question_slice(src, tmp_path / "check" / "test.parquet", bench.SUBSET, bench.SUBSET)
    assert pq.read_table(dst)["row_id"].to_pylist() == list(range(256, 512))
    pq.write_table(pa.table({"row_id": list(range(300))}), src)  # a changed source is re-sliced, or refused
    try:
        bench.question_slice(src, dst, bench.SUBSET, bench.SUBSET)
        raise AssertionError("a 300-row source cannot give rows 256-511")
    except SystemExit as e:
        assert "rows 256..511" in str(e)
    base, after = {**_eval(10 / 256, 200.0), "strict_format_rate": 0.1}, {**_eval(13 / 256, 190.0),
                                                                           "strict_format_rate": 0.2}
    runs = [{"seed": 1, "check": {"base": base, "after": after}}, {"seed": 2}]
    lines = bench.check_lines(runs)
    assert len(lines) == 1 and lines[0].startswith("Seed 1 on test questions 257-512 ")
    assert "10 -> 13 right (####: 0.100 -> 0.200)." in lines[0]


def test_the_settings_line_names_every_override_a_section_ran_with():
    line = "".join(bench.settings_line("GSM8K_TRAIN", bench.GSM8K_TRAIN, bench.GSM8K_EVAL))
    assert all(o in line for o in (*bench.GSM8K_TRAIN, *bench.GSM8K_EVAL))
    assert "`data.val_max_samples=64 trainer.test_freq=6 actor.optim.lr=2e-6 " in line


def test_the_paired_split_counts_questions_gained_and_lost_and_its_exact_p_value(tmp_path):
    """GSM8K accuracies of 3 % overlap whatever a run does; the page's paired split (gained / lost against the base,
    McNemar's exact p) is what tells a change from answers flipping, so it must count the right questions."""
    work = tmp_path / "work"
    for name, right in (("base", {1, 2, 3, 4, 5, 6, 7, 8}), ("run", {1, 2, 9})):
        (work / f"eval_{name}").mkdir(parents=True)
        (work / f"eval_{name}" / "samples.jsonl").write_text("".join(
            json.dumps({"row": i, "correct": i in right}) + "\n" for i in range(20)))
    split = bench.paired(work, "base", "run")
    assert (split["gained"], split["lost"]) == (1, 6)
    assert split["mcnemar_p"] == 2 * (1 + 7) / 2 ** 7  # binomial(7, 1/2): P(X <= 1), doubled
    assert bench.mcnemar_p(0, 0) == 1.0 and bench.mcnemar_p(5, 5) == 1.0 and bench.mcnemar_p(0, 10) == 2 / 2 ** 10
    assert bench.paired(work, "base", "missing") is None
    runs = [{"seed": 2, "paired": split, "base": _eval(0.4, 1.0), "after": _eval(0.15, 1.0), "reward_ends": None,
             "kl_k3_ends": None, "steps": 1, "wall_s": 60.0, "date": "d", "source": "s", "name": "x"},
            {"seed": "token_is, seed 2", "paired": split, "base": _eval(0.4, 1.0), "after": _eval(0.15, 1.0),
             "reward_ends": None, "kl_k3_ends": None, "steps": 1, "wall_s": 60.0, "date": "d", "source": "s",
             "name": "y"}]
    lines = bench.task_section("t", runs, tmp_path, "g")
    assert "Seed 2, question by question against the base: 1 gained, 6 lost (exact McNemar p = 0.125)." in lines
    assert "token_is, seed 2, question by question against the base: 1 gained, 6 lost (exact McNemar p = 0.125)." \
        in lines


def test_device_cuda_runs_only_the_gsm8k_runs():
    import pytest

    for extra in ([], ["--tasks", "gsm8k"], ["--tasks", "gsm8k", "--offline-steps", "0", "--gsm8k-check"]):
        with pytest.raises(SystemExit) as stopped:
            bench.main(["--device", "cuda", *extra])
        assert stopped.value.code == 2


def test_the_gpu_setting_is_the_tables_with_its_scale_winning(tmp_path):
    """GSM8K_GPU changes the samples a step and nothing the CPU table's setting decides (lr, reward, estimator,
    stop); it comes after GSM8K_TRAIN, so its batch sizes are the ones that run."""
    from megatron_ppo.config import load_config

    cfg = load_config("smollm2_gsm8k", [*bench.GSM8K_TRAIN, *bench.GSM8K_GPU, *bench.GPU_RUN])
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size) == (64, 8, 16)
    assert (cfg.cluster.launcher, cfg.cluster.device) == ("local", "cuda")
    assert cfg.actor.optim.lr == 2e-6 and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False and cfg.reward.format_score == 0.1
    assert cfg.rollout.stop_pattern == r"####[^\n]*\n" and cfg.rollout.temperature == 0.7
    assert cfg.actor.model.dtype == "float32"


def _fake_cli(calls: list):
    """Stands in for `megatron-ppo train / eval` (their real runs are the benchmark): writes what each leaves
    behind (a run's metrics and checkpoint dir, an eval's eval.json and samples) and records the arguments."""
    def cli(log: Path, *args: str) -> float:
        calls.append(args)
        if args[0] == "train":
            value = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
            _run_dir(Path(value["trainer.log_dir"]).parent, "", [0.1, 0.2])
            steps = value["trainer.total_training_steps"]
            (Path(value["trainer.default_local_dir"]) / f"global_step_{steps}" / "actor").mkdir(parents=True)
        else:
            out = Path(args[args.index("--out") + 1])
            right = {0, 1} if "gsm8k_gpu_base" in out.name else {1, 2, 3}
            (out / "eval.json").write_text(json.dumps({**_eval(len(right) / 4, 100.0), "strict_format_rate": 0.1}))
            (out / "samples.jsonl").write_text("".join(json.dumps(
                {"row": i, "correct": i in right, "response": "#### 1", "ground_truth": "1"}) + "\n"
                for i in range(4)))
        return 30.0
    return cli


def test_the_gpu_runs_train_every_seed_at_the_gpu_scale_and_keep_their_records(tmp_path, monkeypatch):
    import argparse

    calls: list = []
    monkeypatch.setattr(bench, "cli", _fake_cli(calls))
    work, page_dir = tmp_path / "work", tmp_path / "page"
    bench.gsm8k_gpu(work, page_dir, argparse.Namespace(seeds=[1, 2], gsm8k_steps=3, reuse=False))
    trains = [c for c in calls if c[0] == "train"]
    assert sorted(next(a for a in c if a.startswith("trainer.seed=")) for c in trains) == [
        "trainer.seed=1", "trainer.seed=2"]
    for c in trains:
        assert c.index("data.train_batch_size=64") > c.index("data.train_batch_size=4")  # the GPU scale wins
        assert all(o in c for o in bench.GPU_RUN)
    evals = [c for c in calls if c[0] == "eval"]
    assert len(evals) == 3 and all(c[c.index("--batch-size") + 1] == "256" for c in evals)
    assert all(o in evals[0] for o in bench.GPU_RUN)  # the base: an HF dir, evaluated on the GPU as the runs are
    runs = bench.load_records(page_dir, "gsm8k_gpu_s")
    assert [r["seed"] for r in runs] == [1, 2] and all(r["side_by_side"] == 2 for r in runs)
    assert runs[0]["paired"]["gained"] == 2 and runs[0]["paired"]["lost"] == 1
    assert bench.load_records(page_dir, "gsm8k_s") == []  # the CPU table's records stay apart
    lines = bench.gpu_section(runs, page_dir)
    assert lines[1].startswith("### GSM8K on one GPU, 32x the samples a step (64 prompts x 8; ")
    assert any(line.startswith("The 2 seeds trained side by side on the one GPU") for line in lines)
    assert f"Command (on a GPU machine): `{bench.GPU_COMMAND}`." in lines


def test_stop_children_stops_a_child_another_thread_waits_on(tmp_path):
    """--device cuda waits on its seeds' runs in threads, where SIGTERM's SystemExit never arrives."""
    import subprocess
    import threading
    import time

    errors: list = []

    def seed():
        try:
            bench.run_child([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "child.log", {})
        except subprocess.CalledProcessError as e:
            errors.append(e)

    thread = threading.Thread(target=seed)
    thread.start()
    deadline = time.monotonic() + 30
    while not bench.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    bench.stop_children(grace_s=10)
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and not bench.RUNNING


def _hold_record(seed, val: dict[int, float], last: float, best: float | None, best_step: int | None, steps=40):
    """A record as hold runs keep it: curves of the validation (step 0 is the base) and the entropy."""
    curves = {"val/test_score/arithmetic": [[s, v] for s, v in val.items()],
              "actor/entropy": [[s, 0.8 - 0.01 * s] for s in range(1, steps + 1)]}
    return {"name": f"arith_hold_s{seed}", "seed": seed, "steps": steps, "wall_s": 3000.0, "base": _eval(0.191, 69.0),
            "after": _eval(last, 11.0), "best_after": None if best is None else _eval(best, 12.0),
            "best_step": best_step, "curves": curves}


def test_the_seed_rows_hand_over_the_best_checkpoint_and_measure_the_late_fall(tmp_path):
    import learning_seeds

    # seed 3 of the issue: validation 0.609 at step 30, 0.375 at step 40 (a 23.4-point fall in the last quarter)
    collapsed = _hold_record(3, {0: 0.266, 10: 0.484, 20: 0.531, 30: 0.609, 40: 0.375}, 0.258, 0.45, 30)
    steady = _hold_record(4, {0: 0.266, 10: 0.5, 20: 0.55, 30: 0.6, 35: 0.58, 40: 0.62}, 0.40, 0.40, 40)
    no_best = _hold_record(5, {0: 0.266, 40: 0.5}, 0.39, None, None)
    assert learning_seeds.late_fall(learning_seeds.validation_curve(collapsed["curves"]), 40) == \
        pytest.approx(0.609 - 0.375)
    assert learning_seeds.late_fall(learning_seeds.validation_curve(steady["curves"]), 40) == pytest.approx(0.02)
    assert learning_seeds.late_fall([(0, 0.9), (10, 0.5)], 40) is None  # no validation in the last quarter
    table = learning_seeds.seed_table([collapsed, steady, no_best])
    assert table[2].startswith("| 3 | 0.258 (+6.7) | 30 (0.609) | 0.450 (+25.9) | +25.9 pts | 23.4 |"), table[2]
    assert table[4].startswith("| 5 | 0.390 (+19.9) | - | - | +19.9 pts | 0.0 |"), table[4]  # the last step's
    line = learning_seeds.summary([collapsed, steady, no_best])
    assert line.startswith("3 seeds: the handed checkpoint's change mean +22.2 pts, worst +19.9 pts; 3 of 3 at >= +15"
                           " pts; 2 of 3 with no late validation more than 5 pts below its best"), line
    figure = learning_seeds.plot_seeds([collapsed, steady], tmp_path / "seeds.png")
    assert figure is not None and figure.stat().st_size > 1000


def test_a_hold_record_keeps_the_runs_curves(tmp_path):
    work = tmp_path / "work"
    _run_dir(work, "arith_hold_s1", [0.1, 0.2, 0.3, 0.4])
    record = bench.run_record(work, "arith_hold_s1", 1, _eval(0.2, 69.0), _eval(0.4, 11.0), 100.0, 4)
    assert record["curves"]["reward/score/mean"] == [[1, 0.1], [2, 0.2], [3, 0.3], [4, 0.4]]
    assert "actor/ppo_kl_k3" not in record["curves"]  # only what the seed comparison plots


def test_the_best_actor_is_the_step_the_runs_best_pointer_names(tmp_path):
    from megatron_ppo.trainer import checkpoint as ckpt

    root = tmp_path / "arith_hold_s1" / "checkpoints"
    (root / "global_step_25" / "actor").mkdir(parents=True)
    assert bench.best_actor(tmp_path, "arith_hold_s1") is None  # a run without trainer.save_best
    ckpt.mark_best(str(root), 25)
    assert bench.best_actor(tmp_path, "arith_hold_s1") == (root / "global_step_25" / "actor", 25)


def test_the_arithmetic_validation_is_held_out_questions_outside_the_test_set(tmp_path):
    """ARITH_HOLD chooses its best step on these: none may be a test question (the handed number is measured on the
    test set) or a train question."""
    import pyarrow.parquet as pq

    from megatron_ppo.data.preprocess import preprocess_arithmetic

    arith = tmp_path / "arithmetic_data"
    preprocess_arithmetic(arith, train_rows=512, test_rows=bench.SUBSET, seed=0, level="multi")
    val = bench.arith_validation(tmp_path, arith)
    questions = {split: {str(r["prompt"]) for r in pq.read_table(f).to_pylist()}
                 for split, f in (("val", val), ("test", arith / "test.parquet"), ("train", arith / "train.parquet"))}
    assert len(questions["val"]) == bench.ARITH_VAL
    assert not questions["val"] & questions["test"] and not questions["val"] & questions["train"]
    assert bench.arith_validation(tmp_path, arith) == val  # a second pass keeps the same questions
    other = tmp_path / "other_seed"
    preprocess_arithmetic(other, train_rows=1, test_rows=bench.SUBSET, seed=1, level="multi")
    with pytest.raises(SystemExit, match="are not .*test.parquet"):  # a test set the pool does not begin with
        bench.arith_validation(tmp_path, other)


def test_the_old_recipes_section_draws_the_seeds_curves_only_where_records_kept_them(tmp_path):
    work, page_dir = tmp_path / "work", tmp_path / "learning_smollm2"
    _run_dir(work, "arith_s3", [0.1, 0.2, 0.3, 0.4])
    kinds = {"1-digit + 1-digit": [9, 16]}
    old = bench.run_record(work, "arith_s3", 3, _eval(0.2, 69.0), _eval(0.26, 10.0), 100.0, 4, kinds, kinds)
    old.pop("curves")  # a record from before the records kept curves (issue 26's seeds 1 and 2)
    assert not any("arith_seeds" in line for line in bench.arith_train_section([old], page_dir))
    new = bench.run_record(work, "arith_s3", 3, _eval(0.2, 69.0), _eval(0.26, 10.0), 100.0, 4, kinds, kinds)
    lines = bench.arith_train_section([old, new], page_dir)
    assert "![arith_seeds](learning_smollm2/arith_seeds.png)" in lines
    assert (page_dir / "arith_seeds.png").stat().st_size > 1000
