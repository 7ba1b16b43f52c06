"""Concatenate the per-area benchmark sections (docs/bench/*.md, each written by its tools/bench_*.py with the
command that produced it) into docs/benchmarks.md."""
import os
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
ORDER = ["kernels", "algo_checks", "data", "models", "peer", "convert"]  # the rest follow alphabetically


LINK = re.compile(r"(\]\()([^)#\s]+)")  # a markdown link's or image's target


def rebase_links(text: str) -> str:
    """Links in docs/bench/*.md are relative to docs/bench/; docs/benchmarks.md sits one level up: ``../x`` becomes
    ``x`` and ``dir/x.png`` becomes ``bench/dir/x.png`` (URLs and anchors stay)."""
    def rebase(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("/"):
            return m.group(0)
        return m.group(1) + os.path.relpath(os.path.normpath(os.path.join("bench", target)), ".")
    return LINK.sub(rebase, text)


def main() -> None:
    sections = sorted((DOCS / "bench").glob("*.md"), key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else 99, p.stem))
    header = ("# Benchmarks\n\nMeasured results, one section per area; each names the command that produced it. "
              "Regenerate a section with its tool, then this page with `python tools/collect_benchmarks.py`.\n"
              "CPU rows were measured on the 2-core development machine, often shared with other jobs: compare "
              "ratios measured side by side in one run, not absolute numbers across sections.\n")
    body = "\n\n".join(rebase_links(p.read_text().strip()) for p in sections)
    (DOCS / "benchmarks.md").write_text(header + "\n" + body + "\n")
    print(f"docs/benchmarks.md: {len(sections)} sections ({', '.join(p.stem for p in sections)})")


if __name__ == "__main__":
    main()
