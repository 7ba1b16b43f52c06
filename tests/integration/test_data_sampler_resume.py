"""Sampler resume in a NEW process: consume k batches, save the state, continue in a fresh interpreter; the
concatenated order must equal an uninterrupted run (k inside an epoch and exactly at an epoch edge)."""
import json
import subprocess
import sys

import pytest

from megatron_ppo.data.sampler import StatefulSampler

ROWS, BATCH, SEED, TOTAL = 23, 5, 7, 14  # 4 batches per epoch (drop_last), so 14 batches span 3.5 epochs

CONTINUE = """
import json, sys
from megatron_ppo.data.sampler import StatefulSampler
state = json.load(open(sys.argv[1]))
s = StatefulSampler(state["num_rows"], state["batch_size"], seed=0, drop_last=state["drop_last"])
s.load_state_dict(state)
print(json.dumps([s.next_batch() for _ in range(int(sys.argv[2]))]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4, 8, 9])  # 2, 9: inside an epoch; 4, 8: exactly at an epoch edge
def test_resume_in_new_process(tmp_path, k):
    uninterrupted = StatefulSampler(ROWS, BATCH, seed=SEED)
    reference = [uninterrupted.next_batch() for _ in range(TOTAL)]
    first = StatefulSampler(ROWS, BATCH, seed=SEED)
    head = [first.next_batch() for _ in range(k)]
    state_file = tmp_path / "sampler.json"
    state_file.write_text(json.dumps(first.state_dict()))
    if k % 4 == 0:
        assert first.state_dict()["position"] == 0 and first.state_dict()["epoch"] == k // 4
    run = subprocess.run([sys.executable, "-c", CONTINUE, str(state_file), str(TOTAL - k)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    tail = json.loads(run.stdout)
    assert head + tail == reference
    flat = [i for b in head + tail for i in b]
    for epoch in range(3):  # every row exactly once per full epoch (3 rows dropped per epoch by drop_last)
        rows = flat[epoch * 20:(epoch + 1) * 20]
        assert len(set(rows)) == 20
