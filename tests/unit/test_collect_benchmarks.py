"""tools/collect_benchmarks.py pastes docs/bench/*.md into docs/benchmarks.md, one level up: every relative link
and image must still point at its file there (a curves PNG of docs/bench/learning_smollm2/ once pointed nowhere)."""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from collect_benchmarks import LINK, rebase_links  # noqa: E402


def test_links_are_rebased_from_docs_bench_to_docs():
    text = ("[up](../trainer.md) ![png](learning_smollm2/arith_s1.png) [page](scaling.md#sweep) "
            "[root](../../README.md) [url](https://example.org/a.md) [anchor](#top)")
    assert rebase_links(text) == ("[up](trainer.md) ![png](bench/learning_smollm2/arith_s1.png) "
                                  "[page](bench/scaling.md#sweep) [root](../README.md) "
                                  "[url](https://example.org/a.md) [anchor](#top)")


def test_every_relative_link_of_a_bench_page_resolves_in_both_places():
    for page in sorted((REPO / "docs" / "bench").glob("*.md")):
        for target in (m.group(2) for m in LINK.finditer(page.read_text())):
            if re.match(r"^[a-z]+:", target) or target.startswith("/"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)}: {target} does not exist"
            rebased = rebase_links(f"]({target}")[2:]
            assert (REPO / "docs" / rebased).exists(), f"{page.name}: {target} -> docs/{rebased} does not exist"
