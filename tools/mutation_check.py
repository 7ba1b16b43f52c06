"""Plant named bugs in a temporary copy of the repo and report which ones the tests catch.

    .venv/bin/python tools/mutation_check.py                 # every mutant, markdown table on stdout
    .venv/bin/python tools/mutation_check.py -k kl_loss      # mutants whose name contains "kl_loss"
    .venv/bin/python tools/mutation_check.py --list

Each mutant is (file, exact old snippet, new snippet, tests to run). The copy is HEAD (``--worktree``: the working
tree's tracked and untracked-but-not-ignored files) plus the built extension (megatron_ppo/*.so); tests run from the copy with the
copy first on sys.path (the venv's editable install points at the original checkout, so the script checks which
megatron_ppo was imported). A snippet that is not found exactly once is an error: a mutant cannot go stale
silently. The listed tests must pass on the unmutated copy first (baseline), else the run stops. Exit status 1
when any mutant survives. Run it before closing an issue that touches the modules below; the table goes in
docs/testing.md.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOSSES = "tests/unit/test_trainer_losses.py"
LEDGER = ("tests/unit/test_convert_ledger.py", "tests/integration/test_convert_mapping.py")
STATE = "tests/unit/test_state_roundtrip.py"
CONFIG_RULES = "tests/unit/test_config.py::test_validation_error_names_the_key"
RESPONSE_LOGITS = "tests/integration/test_models_response_logits.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


MUTANTS = [
    # the four bugs of issue 11
    Mutant("kl_loss_sign", "megatron_ppo/workers/losses.py",
           "loss = loss + actor_cfg.kl_loss_coef * kl_loss", "loss = loss - actor_cfg.kl_loss_coef * kl_loss",
           (LOSSES,), "actor loss: KL-loss term's sign flipped"),
    Mutant("ledger_unwritten_check_removed", "megatron_ppo/convert/ledger.py",
           "        if unwritten:\n", "        if False:\n", LEDGER, "Ledger.check: 'target never written' removed"),
    Mutant("ledger_balance_check_removed", "megatron_ppo/convert/ledger.py",
           "if not problems and balance != self.params_out:", "if False:", LEDGER,
           "Ledger.check: parameter-balance check removed"),
    Mutant("adaptive_kl_load_forgets_target_horizon", "megatron_ppo/algo/kl_control.py",
           'self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), '
           'float(state["horizon"])', 'self.value = float(state["value"])',
           (STATE, "tests/unit/test_algo_kl_control.py"), "AdaptiveKLController.load_state_dict: target, horizon "
                                                          "not restored"),
    # losses
    Mutant("entropy_bonus_sign", "megatron_ppo/workers/losses.py",
           "loss = pg_loss - actor_cfg.entropy_coeff * entropy_loss",
           "loss = pg_loss + actor_cfg.entropy_coeff * entropy_loss", (LOSSES,), "entropy bonus sign flipped"),
    Mutant("dual_clip_bound", "megatron_ppo/algo/losses.py",
           "losses_dual = -advantages * clip_ratio_c", "losses_dual = -advantages * (clip_ratio_c + 1.0)",
           (LOSSES,), "dual-clip caps at clip_ratio_c + 1"),
    Mutant("is_weights_ignored", "megatron_ppo/algo/losses.py",
           "pg_losses = pg_losses * rollout_is_weights.detach()", "pg_losses = pg_losses", (LOSSES,),
           "rollout IS weights ignored in the policy loss"),
    Mutant("token_mean_local_normaliser", "megatron_ppo/workers/losses.py",
           '"batch_num_tokens": mini_batch_tokens,', '"batch_num_tokens": None,', (LOSSES,),
           "token-mean normalised by the micro-batch's tokens instead of the mini-batch's"),
    Mutant("critic_seq_normaliser_local", "megatron_ppo/workers/losses.py",
           "global_batch_size=mini_batch_seqs)", "global_batch_size=None)", (LOSSES,),
           "critic seq-mean modes normalised by the micro-batch's rows"),
    # packing
    Mutant("resp_pos_off_by_one", "megatron_ppo/data/batch.py",
           "batch.prompt_ids[i].numel() - 1 + steps", "batch.prompt_ids[i].numel() + steps",
           (LOSSES, "tests/unit/test_data_batch.py"), "pack_rows: resp_pos one token late"),
    Mutant("logit_positions_off_by_one", "megatron_ppo/models/gpt.py",
           "flat.index_select(0, positions.to(flat.device))",
           "flat.index_select(0, (positions.to(flat.device) + 1).clamp(max=b * s - 1))",
           (RESPONSE_LOGITS,), "LM head run one position late (logit_positions)"),
    Mutant("logit_positions_sp_grad_reduced_twice", "megatron_ppo/models/gpt.py",
           "hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp)",
           "hidden_states, tensor_parallel_output_grad=True, group=self.pg_collection.tp)",
           (RESPONSE_LOGITS,), "logit_positions under SP: the hidden-state gradient summed over TP twice"),
    # rollout correction
    Mutant("is_truncation_ignored", "megatron_ppo/algo/rollout_correction.py",
           "weights = raw.clamp(max=upper)", "weights = raw", ("tests/unit/test_algo_rollout_correction.py",),
           "truncated IS: threshold ignored"),
    Mutant("rejection_mask_inverted", "megatron_ppo/algo/rollout_correction.py",
           "keep &= option_keep", "keep &= ~option_keep", ("tests/unit/test_algo_rollout_correction.py",),
           "rejection keeps the tokens it should reject"),
    # advantages
    Mutant("gae_gamma_lam_swapped_in_ops_reference", "megatron_ppo/ops/reference.py",
           "compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)",
           "compute_gae_advantage_return(token_level_rewards, values, response_mask, lam, gamma)",
           ("tests/unit/test_ops_gae.py",), "ops reference GAE with gamma and lam swapped"),
    # conversion ledger
    Mutant("ledger_double_write_check_removed", "megatron_ppo/convert/ledger.py",
           "if ident in self.written:", "if False:", LEDGER, "Ledger.write: 'written twice' removed"),
    # config
    Mutant("config_clip_ratio_c_refusal_removed", "megatron_ppo/config/checks.py",
           'errs.check(a.clip_ratio_c > 1.0, "actor.clip_ratio_c"', 'errs.check(True, "actor.clip_ratio_c"',
           (CONFIG_RULES,), "config: clip_ratio_c <= 1 accepted"),
    # checkpointed state
    Mutant("target_kl_guard_target_not_restored", "megatron_ppo/algo/kl_control.py",
           'self.target_kl = None if state["target_kl"] is None else checks.real_number(\n'
           '            state["target_kl"], "target_kl", low=0.0, low_inclusive=False)',
           "self.target_kl = self.target_kl", (STATE, "tests/unit/test_algo_kl_control.py"),
           "TargetKLGuard.load_state_dict: target_kl not restored"),
    Mutant("phased_kl_step_not_restored", "megatron_ppo/algo/kl_control.py",
           'self.step = checks.integer(state["step"], "step", low=0)', "pass",
           (STATE, "tests/unit/test_algo_kl_control.py"), "PhasedKLController.load_state_dict: step not restored"),
    Mutant("sampler_position_not_restored", "megatron_ppo/data/sampler.py",
           'self.epoch, self.position, self.seed = epoch, position, int(state["seed"])',
           'self.epoch, self.seed = epoch, int(state["seed"])',
           (STATE, "tests/unit/test_data_sampler.py"), "StatefulSampler.load_state_dict: position not restored"),
]

# To add once the distributed driver lands (trainer/ppo.py and workers/ are being rewritten): mini-batch token
# count taken from response_mask instead of loss_mask, lr schedule stepped per optimizer step, ref log-probs
# from the actor, micro-batch losses averaged instead of summed, KL guard reading k1 instead of k3.


CHECK_CALL = re.compile(r"^(\s*)(errs\.(?:check|positive|non_negative|unit_interval|minus_one_or_positive|append)\()",
                        re.M)


def config_rule_mutants(root: str = ROOT) -> list[Mutant]:
    """One mutant per rule call in config/checks.py: the call is skipped (``None and errs.check(...)``). Names
    carry the line number; run with --config-sweep."""
    path = "megatron_ppo/config/checks.py"
    with open(os.path.join(root, path)) as f:
        text = f.read()
    out = []
    for match in CHECK_CALL.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        end = text.index("\n", match.start())
        old = text[match.start():end]
        if text.count(old) != 1:  # the same text twice: widen the snippet by the previous line
            start = text.rindex("\n", 0, match.start() - 1) + 1
            old = text[start:end]
        new = old.replace(match.group(2), "None and " + match.group(2), 1)
        out.append(Mutant(f"config_rule_L{line}", path, old, new, (CONFIG_RULES, "tests/unit/test_config_yaml.py"),
                          f"config/checks.py line {line} skipped"))
    return out


def _copy_tree(dest: str, worktree: bool) -> None:
    """HEAD's files (default: what is committed, untouched by edits in progress), or with ``worktree`` the
    working tree's tracked and untracked-but-not-ignored files; plus the built extension either way."""
    os.makedirs(dest)
    if worktree:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                               capture_output=True).stdout.decode().split("\0")
    else:
        archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        files = []
    files += [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "megatron_ppo", "**", "*.so"),
                                                           recursive=True)]
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):  # deleted in the working tree
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def _env(copy: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = copy + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _check_import(copy: str) -> None:
    out = subprocess.run([sys.executable, "-c", "import megatron_ppo; print(megatron_ppo.__file__)"], cwd=copy,
                         env=_env(copy), check=True, capture_output=True, text=True).stdout.strip()
    if not os.path.realpath(out).startswith(os.path.realpath(copy) + os.sep):
        raise SystemExit(f"mutation_check: megatron_ppo imported from {out}, not from the copy {copy}")


def _pytest(copy: str, tests: tuple[str, ...]) -> tuple[int, list[str], str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", "-p", "no:warnings",
           *tests]
    proc = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    return proc.returncode, failed, proc.stdout[-3000:] + proc.stderr[-2000:]


def _original(copy: str, mutant: Mutant) -> str:
    """The file's text; exits when the snippet is not there exactly once (a stale mutant)."""
    with open(os.path.join(copy, mutant.path)) as f:
        text = f.read()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(f"mutation_check: mutant {mutant.name}: snippet found {count} times in {mutant.path} "
                         f"(expected exactly once; update the mutant):\n{mutant.old}")
    return text


def _apply(copy: str, mutant: Mutant) -> str:
    text = _original(copy, mutant)
    with open(os.path.join(copy, mutant.path), "w") as f:
        f.write(text.replace(mutant.old, mutant.new))
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--worktree", action="store_true",
                        help="mutate a copy of the working tree (uncommitted edits included) instead of HEAD")
    parser.add_argument("--config-sweep", action="store_true",
                        help="instead of the named mutants: skip each rule call of config/checks.py in turn")
    args = parser.parse_args(argv)
    def select(root):
        return [m for m in (config_rule_mutants(root) if args.config_sweep else MUTANTS) if args.k in m.name]

    mutants = select(ROOT)
    if args.list:
        for m in mutants:
            print(f"{m.name:45s} {m.path}: {m.what}")
        return 0
    if not mutants and not args.config_sweep:  # the sweep's line numbers are the copy's: checked there
        raise SystemExit(f"mutation_check: no mutant matches {args.k!r}")
    rows, survived = [], 0
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as tmp:
        # <tmp>/main + <tmp>/shared -> the real shared/: paths "beside the repository" resolve as in the checkout
        copy = os.path.join(tmp, os.path.basename(ROOT))
        shared = os.path.join(os.path.dirname(ROOT), "shared")
        if os.path.isdir(shared):
            os.symlink(shared, os.path.join(tmp, "shared"))
        _copy_tree(copy, args.worktree)
        _check_import(copy)
        mutants = select(copy)  # the sweep's snippets come from the copy's own checks.py
        if not mutants:
            raise SystemExit(f"mutation_check: no mutant matches {args.k!r}")
        for m in mutants:  # every snippet must exist before anything runs
            _original(copy, m)
        baseline = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        code, failed, tail = _pytest(copy, baseline)
        if code != 0:
            raise SystemExit(f"mutation_check: the tests fail without any mutant ({failed}):\n{tail}")
        for m in mutants:
            original = _apply(copy, m)
            start = time.monotonic()
            try:
                code, failed, tail = _pytest(copy, m.tests)
            finally:
                with open(os.path.join(copy, m.path), "w") as f:
                    f.write(original)
            killed = code != 0
            if code not in (0, 1):  # 1: tests failed; anything else (collection error, crash) is still a kill
                failed = failed or [f"pytest exit {code}"]
            survived += not killed
            rows.append((m, killed, failed, time.monotonic() - start))
            print(f"{m.name}: {'killed' if killed else 'SURVIVED'} ({time.monotonic() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    print("| mutant | file | planted bug | result | first failing test |")
    print("|---|---|---|---|---|")
    for m, killed, failed, _ in rows:
        print(f"| `{m.name}` | `{m.path}` | {m.what} | {'killed' if killed else '**SURVIVED**'} | "
              f"{'`' + failed[0] + '`' if failed else '-'} |")
    print(f"\n{len(rows) - survived} of {len(rows)} mutants killed.")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
