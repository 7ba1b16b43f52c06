"""The config package's modules import one another in one direction only (no circle, no import hidden inside a
function to dodge one), and the package imports in a fresh interpreter."""
from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ppo" / "config"
MODULES = ("schema", "io", "checks", "verl_compat", "load")
LEAVES = ("schema", "io")  # the dataclasses and the YAML/building plumbing need nothing else of the package


def package_imports(source: str, modules=MODULES) -> set[str]:
    """Sibling modules that `source` imports anywhere (module level or inside a function), relatively
    (`from .io import x`, `from . import io`) or absolutely (`megatron_ppo.config.io`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                names = [base] if base else [a.name for a in node.names]
            elif node.level == 0 and base.startswith("megatron_ppo.config"):
                rest = base[len("megatron_ppo.config"):].lstrip(".")
                names = [rest] if rest else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name[len("megatron_ppo.config."):] for a in node.names
                     if a.name.startswith("megatron_ppo.config.")]
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in modules}
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    return {name: package_imports(text, tuple(sources)) - {name} for name, text in sources.items()}


def test_config_modules_form_a_dag():
    present = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert present == sorted(MODULES), f"update MODULES (and the package docstring) for {present}"
    graph = import_graph({m: (PACKAGE / f"{m}.py").read_text() for m in MODULES})
    order = list(TopologicalSorter(graph).static_order())  # CycleError names the circle
    assert set(order) == set(MODULES)
    for leaf in LEAVES:
        assert graph[leaf] == set(), f"config/{leaf}.py must not import {graph[leaf]}"


def test_the_checker_finds_a_circle_and_a_hidden_import():
    """The old layout: config.py imported config_io at the top and config_checks inside a function, and
    config_checks imported config: a circle that the function-level import hid."""
    old = {"config": "from .config_io import field\n\ndef load():\n    from .config_checks import validate\n",
           "config_io": "import yaml\n",
           "config_checks": "from .config import PPOConfig\nfrom .config_io import ConfigError\n"}
    graph = import_graph(old)
    assert graph == {"config": {"config_io", "config_checks"}, "config_io": set(),
                     "config_checks": {"config", "config_io"}}
    with pytest.raises(CycleError):
        list(TopologicalSorter(graph).static_order())
    absolute = "import megatron_ppo.config.io\nfrom megatron_ppo.config import checks\n"
    assert package_imports(absolute) == {"io", "checks"}


@pytest.mark.parametrize("module", ("megatron_ppo.config",) + tuple(f"megatron_ppo.config.{m}" for m in MODULES))
def test_each_module_imports_in_a_fresh_interpreter(module):
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
