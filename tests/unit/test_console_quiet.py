"""What a run prints by default: transformers' advice lines (tokenizer notes) stay off the screen; a FILE_ONLY record
(routine notices such as the heap the ranks gave back before a save) goes to the run log, not the screen; --verbose
shows both. Each case in a fresh interpreter: logging's handlers are process-wide."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import logging, sys
    from megatron_ppo import console
    console.setup_logging()
    console.set_run_log(sys.argv[1])
    from transformers.utils import logging as hf_logging
    hf_logging.get_logger("transformers.tokenization_utils_base").warning("TOKENIZER ADVICE")
    logging.getLogger("megatron_ppo.trainer.ppo").info("HEAP NOTICE", extra=console.FILE_ONLY)
    logging.getLogger("megatron_ppo.trainer.ppo").info("STEP LINE")
""")


@pytest.mark.parametrize("verbose", [False, True])
def test_advice_and_file_only_notices_stay_off_the_screen_unless_verbose(tmp_path, verbose):
    env = {"MEGATRON_PPO_VERBOSE": "1"} if verbose else {}
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "MEGATRON_PPO_VERBOSE")}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "train.log")], capture_output=True, text=True,
                         timeout=120, env={**base, **env})  # (an earlier quiet() in this process set the first)
    assert run.returncode == 0, run.stderr
    screen, log = run.stdout + run.stderr, (tmp_path / "train.log").read_text()
    assert "STEP LINE" in screen and "STEP LINE" in log
    assert "HEAP NOTICE" in log and ("HEAP NOTICE" in screen) == verbose
    assert ("TOKENIZER ADVICE" in screen) == verbose
