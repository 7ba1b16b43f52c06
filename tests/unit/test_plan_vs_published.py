"""docs/bench/scaling.md's planner-vs-published section is what tools/bench_plan_vs_published.py writes today (a
planner change that moves a number must regenerate the page), and the tool rewrites only its own section."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("bench_plan_vs_published", REPO / "tools/bench_plan_vs_published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_page_section_is_current():
    tool = _tool()
    page = tool.PAGE.read_text()
    assert page.count(tool.BEGIN) == 1 and page.count(tool.END) == 1
    assert tool.render_page(page) == page, "run: .venv/bin/python tools/bench_plan_vs_published.py"
    assert tool.COMMAND in page


def test_only_the_marked_section_is_rewritten(tmp_path):
    tool = _tool()
    page = tmp_path / "scaling.md"
    page.write_text(f"# head\n\nkept above\n\n{tool.BEGIN}\nold\n{tool.END}\n\nkept below\n")
    assert tool.main(["--page", str(page), "--check"]) == 1
    assert tool.main(["--page", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# head\n\nkept above\n\n") and text.endswith(f"{tool.END}\n\nkept below\n")
    assert "old" not in text.split(tool.BEGIN)[1].split("\n")[1] and tool.main(["--page", str(page), "--check"]) == 0
    bare = tmp_path / "bare.md"
    bare.write_text("# only\n")
    tool.main(["--page", str(bare)])
    assert bare.read_text().startswith("# only\n\n" + tool.BEGIN)


def test_published_numbers_are_the_quoted_ones():
    """The numbers the page compares against, as NeMo-RL v0.5 and verl print them (and as issue 27 quotes them)."""
    tool = _tool()
    llama, qwen = tool.NEMO_RL
    assert (llama["gpus"], llama["tokens_per_s_gpu"], llama["step_s"]) == (16, 1581, 92.8)
    assert (qwen["gpus"], qwen["tokens_per_s_gpu"], qwen["step_s"]) == (32, 571, 376)
    assert [mfu for _, _, mfu in tool.VERL_MFU] == [0.40, 0.37, 0.31]
