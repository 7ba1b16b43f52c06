"""CI's property tests are reproducible: .ci/run selects the derandomized "ci" hypothesis profile (tests/conftest.py)
and the settings objects that test modules build at import inherit it."""
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings

ROOT = Path(__file__).resolve().parents[2]


def test_ci_profile_is_reproducible():
    ci = settings.get_profile("ci")
    assert ci.derandomize is True and ci.database is None and ci.deadline is None and ci.print_blob is True
    assert settings.get_profile("dev").derandomize is False  # local runs keep exploring


def test_ci_run_selects_the_ci_profile():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line.strip().startswith("export HYPOTHESIS_PROFILE=ci") for line in lines)


def test_module_settings_inherit_the_profile_from_the_environment():
    """A test module's ``settings(max_examples=40)`` keeps its own keys and takes the rest from HYPOTHESIS_PROFILE."""
    code = (
        "import runpy, sys; runpy.run_path('tests/conftest.py'); sys.path.insert(0, 'tests/unit');"
        "import test_algo_advantages as t; f = t.FAST;"
        "print(f.derandomize, f.database, f.max_examples)"
    )
    env = dict(os.environ, HYPOTHESIS_PROFILE="ci")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "None", "40"]
