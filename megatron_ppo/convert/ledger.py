"""Completeness accounting for a conversion: nothing dropped, nothing doubled, parameter counts balance.

Every source tensor must be consumed exactly once and every target tensor written exactly once; the parameter
count out equals the count in plus the vocab padding added (HF -> Megatron) or minus the padding dropped
(Megatron -> HF). Anything skipped on purpose (derived buffers, a tied duplicate, optimizer state) is listed with
its reason. ``check()`` raises with the names; ``table()`` is the summary printed at the end.
"""
from __future__ import annotations

from collections import defaultdict

from megatron_ppo.convert.mapping import ConversionError

CATEGORIES = ("embedding", "attention", "mlp", "norm", "output")


def category_of(name: str) -> str:
    """Summary row for a tensor name of either side."""
    n = name.lower()
    if "norm" in n:
        return "norm"
    if "embed" in n:
        return "embedding"
    if "lm_head" in n or "output_layer" in n:
        return "output"
    if "attn" in n or "attention" in n:
        return "attention"
    if "mlp" in n:
        return "mlp"
    return "other"


class Ledger:
    def __init__(self, title: str):
        self.title = title
        self.sources: dict = {}
        self.targets: dict = {}
        self.consumed: set = set()
        self.written: set = set()
        self.skipped: dict[str, list[str]] = defaultdict(list)
        self.padding_added = 0
        self.padding_dropped = 0
        self.rows = defaultdict(lambda: [0, 0, 0, 0])  # category -> [src tensors, src params, tgt tensors, tgt params]

    def expect_source(self, ident, numel: int, category: str) -> None:
        self.sources[ident] = (numel, category)

    def expect_target(self, ident, numel: int, category: str) -> None:
        self.targets[ident] = (numel, category)

    def consume(self, ident) -> None:
        if ident not in self.sources:
            raise ConversionError(f"{self.title}: consumed {ident!r}, which is not an expected source tensor")
        if ident in self.consumed:
            raise ConversionError(f"{self.title}: source tensor {ident!r} consumed twice")
        self.consumed.add(ident)
        numel, cat = self.sources[ident]
        self.rows[cat][0] += 1
        self.rows[cat][1] += numel

    def write(self, ident, numel: int) -> None:
        if ident not in self.targets:
            raise ConversionError(f"{self.title}: wrote {ident!r}, which is not an expected target tensor")
        if ident in self.written:
            raise ConversionError(f"{self.title}: target tensor {ident!r} written twice")
        want, cat = self.targets[ident]
        if numel != want:
            raise ConversionError(f"{self.title}: target {ident!r} has {numel} elements, expected {want}")
        self.written.add(ident)
        self.rows[cat][2] += 1
        self.rows[cat][3] += numel

    def skip(self, ident, reason: str) -> None:
        self.skipped[reason].append(str(ident))

    @property
    def params_in(self) -> int:
        return sum(self.sources[i][0] for i in self.consumed)

    @property
    def params_out(self) -> int:
        return sum(self.targets[i][0] for i in self.written)

    def check(self) -> None:
        problems = []
        unconsumed = [i for i in self.sources if i not in self.consumed]
        unwritten = [i for i in self.targets if i not in self.written]
        if unconsumed:
            problems.append(f"{len(unconsumed)} source tensors never consumed: {unconsumed[:8]}")
        if unwritten:
            problems.append(f"{len(unwritten)} target tensors never written: {unwritten[:8]}")
        balance = self.params_in + self.padding_added - self.padding_dropped
        if not problems and balance != self.params_out:
            problems.append(f"parameter count in {self.params_in} (+{self.padding_added} padding added, "
                            f"-{self.padding_dropped} padding dropped) != out {self.params_out}")
        if problems:
            raise ConversionError(f"{self.title}: incomplete conversion: " + "; ".join(problems))

    def summary(self) -> dict:
        return {
            "source_tensors": len(self.consumed), "target_tensors": len(self.written),
            "params_in": self.params_in, "params_out": self.params_out,
            "padding_added": self.padding_added, "padding_dropped": self.padding_dropped,
            "skipped": {k: len(v) for k, v in self.skipped.items()},
        }

    def table(self, extra_rows: list[tuple[str, str]] = ()):
        """The summary: per-category counts and totals, then skips, padding, the verdict and any extra lines."""
        from rich.console import Group
        from rich.table import Table

        t = Table(title=f"{self.title}: verification summary")
        for col in ("", "source tensors", "source params", "target tensors", "target params"):
            t.add_column(col, justify="left" if not col else "right")
        for cat in [c for c in CATEGORIES if c in self.rows] + [c for c in self.rows if c not in CATEGORIES]:
            st, sp, tt, tp = self.rows[cat]
            t.add_row(cat, str(st), f"{sp:,}", str(tt), f"{tp:,}")
        total = [sum(r[i] for r in self.rows.values()) for i in range(4)]
        t.add_row("total", str(total[0]), f"{total[1]:,}", str(total[2]), f"{total[3]:,}", style="bold")

        facts = Table(show_header=False, box=None, padding=(0, 2))
        facts.add_column(style="bold")
        facts.add_column()
        ok = (not [i for i in self.sources if i not in self.consumed]
              and not [i for i in self.targets if i not in self.written])
        facts.add_row("complete", "every source tensor consumed once, every target written once" if ok else "NO")
        facts.add_row("parameters", f"in {self.params_in:,} / out {self.params_out:,}")
        if self.padding_added:
            facts.add_row("vocab padding", f"{self.padding_added:,} zero parameters added")
        if self.padding_dropped:
            facts.add_row("vocab padding", f"{self.padding_dropped:,} parameters dropped")
        for reason, names in self.skipped.items():
            facts.add_row("skipped", f"{len(names)} x {reason}")
        for label, value in extra_rows:
            facts.add_row(label, value)
        return Group(t, facts)
