"""Every pointer to a repository path in the code, tools and docs names something that exists: test files (and
``file.py::test_name`` functions), tools, docs pages, configs, kernel sources; and every relative markdown link
resolves. A docstring that promises a test which does not exist is a defect this test catches."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["megatron_ppo", "docs", "tools", "csrc", "README.md"]
SUFFIXES = {".py", ".md", ".h", ".cpp", ".cu", ".cuh", ".sh", ".txt", ".yaml", ".toml"}
# a path starting at a top-level directory of the repository, optionally followed by ::test_name
POINTER = re.compile(r"(?<![\w/.-])((?:tests|tools|docs|megatron_ppo|csrc|configs|slurm|\.ci)/[\w./*{},-]*[\w*}])"
                     r"(?:::(\w+))?")
LINK = re.compile(r"\]\(([^)#\s]+)")


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        files += [path] if path.is_file() else [p for p in sorted(path.rglob("*"))
                                                 if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return files


def expand_braces(ref: str) -> list[str]:
    """``test_models_{arch,logprobs}.py`` -> both names (shell brace expansion, one level per group)."""
    parts = re.split(r"\{([^{}]*)\}", ref)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def pointer_exists(ref: str, test_name: str | None) -> bool:
    for candidate in expand_braces(ref.rstrip(".,")):
        matches = list(ROOT.glob(candidate)) if "*" in candidate else [ROOT / candidate]
        if not matches or not all(m.exists() for m in matches):
            return False
        if test_name and not any(re.search(rf"^\s*(async\s+)?def {test_name}\b", m.read_text(), re.M)
                                 for m in matches if m.is_file()):
            return False
    return True


def dangling_pointers(files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{lineno}"
            for match in POINTER.finditer(line):
                if not pointer_exists(match.group(1), match.group(2)):
                    bad.append(f"{where}: {match.group(0)}")
            if path.suffix == ".md":
                for link in LINK.findall(line):
                    if not link.startswith(("http:", "https:", "mailto:")) and not (path.parent / link).exists():
                        bad.append(f"{where}: link {link}")
    return bad


def test_every_path_pointer_in_code_tools_and_docs_exists():
    bad = dangling_pointers(scanned_files())
    assert not bad, "pointers to paths that do not exist:\n" + "\n".join(bad)


def test_the_checker_catches_what_it_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see tests/unit/test_algo_imports.py and tests/unit/test_algo_checks.py::no_such_test;\n"
                    "tests/unit/test_algo_{checks,nope}.py, [x](missing.md); fine: tests/unit/test_algo_checks.py,\n"
                    "tests/unit/test_algo_{checks,losses}.py, tests/unit/test_ops_*.py, [me](page.md)\n")
    bad = dangling_pointers([page])
    bad = [b.split(": ", 1)[1] for b in bad]
    assert bad == ["tests/unit/test_algo_imports.py", "tests/unit/test_algo_checks.py::no_such_test",
                   "tests/unit/test_algo_{checks,nope}.py", "link missing.md"]
