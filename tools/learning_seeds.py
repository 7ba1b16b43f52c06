"""The seed-by-seed part of docs/bench/learning_smollm2.md (issue 51): per-step curves kept in each run's record,
how far a run's validation fell from its best late in the run, the table of every seed (the last step's checkpoint
and the best one that trainer.save_best keeps), the mean and the worst seed, and the curves of every seed side by
side. Pure functions of run records (tools/bench_learning_smollm2.py writes them), so a page can be rebuilt from
records of earlier sessions and the rows are tested (tests/unit/test_bench_learning_smollm2.py)."""
from __future__ import annotations

import math
from pathlib import Path

# what issue 51 asks to compare between seeds, a panel each in the side-by-side figure
CURVE_KEYS = ("reward/score/mean", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "response_length/mean",
              "critic/advantages/mean", "actor/grad_norm", "critic/vf_explained_var")
VAL_PREFIX = "val/test_score/"
LATE_FRACTION = 0.25  # "the last quarter of the run"


def run_curves(records: list[dict]) -> dict[str, list[list[float]]]:
    """{metric: [[step, value], ...]} of CURVE_KEYS and every validation score in a run's metrics.jsonl records
    (finite values only; step 0 is the validation before training)."""
    out: dict[str, list[list[float]]] = {}
    for r in records:
        for key, value in r.items():
            if (key in CURVE_KEYS or key.startswith(VAL_PREFIX)) and isinstance(value, int | float) \
                    and math.isfinite(float(value)):
                out.setdefault(key, []).append([int(r["step"]), float(value)])
    return out


def validation_curve(curves: dict) -> list[tuple[int, float]]:
    """(step, score) of each validation: the mean over data sources, as trainer.best_metric's default."""
    by_step: dict[int, list[float]] = {}
    for key, points in curves.items():
        if key.startswith(VAL_PREFIX):
            for step, value in points:
                by_step.setdefault(int(step), []).append(value)
    return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())]


def late_fall(val: list[tuple[int, float]], steps: int) -> float | None:
    """The largest drop, in score units, of a validation in the last quarter of the run (step > 3/4 of ``steps``)
    below the best validation up to it (training steps only: step 0 is the base model); None without one."""
    best, fall = -math.inf, None
    for step, score in val:
        if step == 0:
            continue
        best = max(best, score)
        if step > (1 - LATE_FRACTION) * steps:
            fall = max(fall or 0.0, best - score)
    return fall


def handed(record: dict) -> dict:
    """The eval of the checkpoint the recipe hands the user: the best validated step's when the run kept one
    (trainer.save_best), else the last step's."""
    return record.get("best_after") or record["after"]


def change(record: dict, which: dict) -> float:
    return 100 * (which["accuracy"] - record["base"]["accuracy"])


def seed_table(runs: list[dict]) -> list[str]:
    """A row per seed: the last step's and the best step's held-out accuracy, which one the user gets, the late
    validation fall, entropy and response length from the first to the last quarter, wall."""
    lines = ["| seed | last step: accuracy (change) | best step (validation) | best step: accuracy (change) | handed "
             "to the user | validation's late fall (pts) | entropy (first -> last quarter) | response length | wall "
             "(min) |", "| ---: | --- | --- | --- | ---: | ---: | --- | --- | ---: |"]
    for r in runs:
        last, best = r["after"], r.get("best_after")
        val = validation_curve(r.get("curves", {}))
        fall = late_fall(val, r["steps"])
        best_val = dict(val).get(r.get("best_step")) if r.get("best_step") is not None else None
        lines.append(
            f"| {r['seed']} | {last['accuracy']:.3f} ({change(r, last):+.1f}) | "
            + (f"{r['best_step']} ({best_val:.3f})" if best_val is not None else "-") + " | "
            + (f"{best['accuracy']:.3f} ({change(r, best):+.1f})" if best else "-") + " | "
            + f"{change(r, handed(r)):+.1f} pts | " + ("-" if fall is None else f"{100 * fall:.1f}") + " | "
            + ends(curve_ends(r, "actor/entropy")) + " | " + ends(curve_ends(r, "response_length/mean"), "{:.0f}")
            + f" | {r['wall_s'] / 60:.1f} |")
    return lines


def summary(runs: list[dict], goal_pts: float = 15.0, goal_fall_pts: float = 5.0) -> str:
    """Mean and worst change of the handed checkpoints over the seeds, and whether every seed holds both goals."""
    changes = [change(r, handed(r)) for r in runs]
    falls = [late_fall(validation_curve(r.get("curves", {})), r["steps"]) for r in runs]
    held = sum(c >= goal_pts for c in changes)
    steady = sum(f is not None and 100 * f <= goal_fall_pts for f in falls)
    return (f"{len(runs)} seed{'s' if len(runs) != 1 else ''}: the handed checkpoint's change mean "
            f"{sum(changes) / len(changes):+.1f} pts, worst {min(changes):+.1f} pts; {held} of {len(runs)} at >= "
            f"+{goal_pts:.0f} pts; {steady} of {len(runs)} with no late validation more than {goal_fall_pts:.0f} "
            "pts below its best")


def quarter_means(xs: list[float]) -> list[float] | None:
    """The means of the first and the last quarter (at most 5 values each) of a series."""
    if not xs:
        return None
    k = max(1, min(5, len(xs) // 4))
    return [sum(xs[:k]) / k, sum(xs[-k:]) / k]


def curve_ends(record: dict, key: str) -> list[float] | None:
    """quarter_means of one kept curve."""
    return quarter_means([v for _, v in record.get("curves", {}).get(key, [])])


def ends(pair: list[float] | None, fmt: str = "{:.2f}") -> str:
    return "-" if pair is None else f"{fmt.format(pair[0])} -> {fmt.format(pair[1])}"


def plot_seeds(runs: list[dict], path: Path) -> Path | None:
    """One panel per CURVE_KEYS metric and one for validation, a line per seed; None when no run kept curves."""
    runs = [r for r in runs if r.get("curves")]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("validation (mean over sources)", None)] + [(k, k) for k in CURVE_KEYS]
    cols = 3
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(4.2 * cols, 3 * math.ceil(len(panels) / cols)))
    for ax, (title, key) in zip(axes.flat, panels):
        for r in runs:
            pts = validation_curve(r["curves"]) if key is None else r["curves"].get(key, [])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if key is None else None,
                        label=f"seed {r['seed']}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    labelled = [ax for ax in axes.flat if ax.get_legend_handles_labels()[0]]
    if labelled:  # the validation panel, unless the runs kept no validation
        labelled[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
