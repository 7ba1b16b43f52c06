"""PNG curves of a run from its metrics.jsonl: `megatron-ppo plot DIR` and the trainer's own refresh (at each
validation and at the end of a run, trainer/tracking.Tracker).

One figure, one panel per quantity (reward, val score, KL, entropy, pg/vf loss, grad norm, response length, step
time), written to DIR/curves.png, plus one PNG per panel in DIR/curves/ for pasting elsewhere. A panel whose metrics
the run never logged is left out (e.g. no critic: no vf loss). matplotlib with the Agg backend: no display needed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
CURVES_DIR = "curves"
# (panel file name, title, metric names; a name ending in "/" stands for every metric under it)
PANELS = (
    ("reward", "mean reward (train)", ("reward/score/mean",)),
    ("val_score", "validation score", ("val/",)),
    ("kl", "KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty", "rollout_corr/kl")),
    ("entropy", "entropy", ("actor/entropy", "actor/entropy_rollout")),
    ("loss", "pg / vf loss", ("actor/pg_loss", "critic/vf_loss")),
    ("grad_norm", "grad norm", ("actor/grad_norm", "critic/grad_norm")),
    ("response_length", "response length", ("response_length/mean", "response_length/max")),
    ("step_time", "step time (s)", ("timing/step",)),
)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl ({"step": N, name: value, ...}); a bad line is an error naming it."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON record ({e.msg})") from None
    return records


def series(records: list[dict], names: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} for the names (prefixes ending in "/" expanded), finite values only."""
    keys = sorted({k for r in records for k in r if k != "step"
                   and any(k == n or (n.endswith("/") and k.startswith(n)) for n in names)})
    out = {}
    for key in keys:
        pts = [(int(r["step"]), float(r[key])) for r in records if isinstance(r.get(key), int | float)
               and math.isfinite(float(r[key]))]
        if pts:
            out[key] = ([s for s, _ in pts], [v for _, v in pts])
    return out


def plot_run(log_dir: str | Path) -> list[Path]:
    """Write DIR/curves.png and DIR/curves/<panel>.png from DIR/metrics.jsonl; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log_dir = Path(log_dir)
    path = log_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (a run's trainer.log_dir holds metrics.jsonl)")
    records = read_metrics(path)
    panels = [(name, title, s) for name, title, names in PANELS if (s := series(records, names))]
    written = []
    (log_dir / CURVES_DIR).mkdir(exist_ok=True)
    for name, title, s in panels:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        _draw(ax, title, s)
        fig.tight_layout()
        written.append(_save(fig, log_dir / CURVES_DIR / f"{name}.png"))
        plt.close(fig)
    if panels:
        cols = 4
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3 * rows), squeeze=False)
        for ax, (_, title, s) in zip(axes.flat, panels):
            _draw(ax, title, s)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(f"{log_dir} ({len(records)} records)", fontsize=9)
        fig.tight_layout()
        written.insert(0, _save(fig, log_dir / CURVES_FILE))
        plt.close(fig)
    return written


def _draw(ax, title: str, s: dict) -> None:
    for key, (steps, values) in s.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp.png")  # atomic: a reader never sees half a PNG
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-ppo plot", description="PNG curves of a run from DIR/metrics.jsonl")
    p.add_argument("dir", help="the run's trainer.log_dir")
    args = p.parse_args(argv)
    try:
        written = plot_run(args.dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"megatron-ppo plot: error: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"megatron-ppo plot: {args.dir}/{METRICS_FILE} has no metric to plot", file=sys.stderr)
        return 2
    print(f"curves: {written[0]} (and {len(written) - 1} panels in {Path(args.dir) / CURVES_DIR})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
