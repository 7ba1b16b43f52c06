"""tests/conftest.py's CI aids: under CI=true a failure is printed as it happens, and past MPPO_TEST_BUDGET_S the
remaining tests fail at once naming the budget (so a cut-short CI log still has pytest's summary)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_spent_budget_fails_the_rest_at_once_and_each_failure_is_printed_when_it_happens():
    env = {**os.environ, "CI": "true", "MPPO_TEST_BUDGET_S": "0.000001"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/unit/test_eval_metrics.py"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1
    assert "MPPO_TEST_BUDGET_S=0 s spent before this test started (not run)" in run.stdout
    assert "FAILED-NOW [" in run.stderr and "test_eval_metrics.py::" in run.stderr
    assert " passed" not in run.stdout.splitlines()[-1] or "error" in run.stdout.splitlines()[-1]
    unlimited = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "tests/unit/test_eval_metrics.py"], cwd=REPO, capture_output=True, text=True,
                               env={k: v for k, v in env.items() if k != "MPPO_TEST_BUDGET_S"}, timeout=300)
    assert unlimited.returncode == 0 and "FAILED-NOW" not in unlimited.stderr
