"""Sample the machine's used memory (total - available, psutil) while a command or a process runs; write a CSV and
print the peak.

Why: the memory numbers in docs/bench/learning_smollm2.md (a run's machine peak against the 24 GB that Ray's memory
monitor guards) must come from a committed command, not a /tmp script. Used = total - available is what Ray's monitor
compares with its threshold on a host without a cgroup limit.

    python tools/sample_memory.py --out outputs/mem.csv -- megatron-ppo train --config smollm2_gsm8k
    python tools/sample_memory.py --out outputs/mem.csv --pid 1234      # until process 1234 exits
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

GIB = 1 << 30


class MemorySampler:
    """A daemon thread that appends ``seconds,used_gib,available_gib`` rows to ``out`` every ``interval_s`` and keeps
    the peak of used memory."""

    def __init__(self, out: Path, interval_s: float = 2.0):
        self.out, self.interval_s = Path(out), interval_s
        self.peak_gib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="memory-sampler")

    def _sample(self, f, start: float) -> None:
        vm = psutil.virtual_memory()
        # rounded as written, so the printed peak is the CSV's peak (peak_from_csv); unrounded, 4.7152 printed 4.72
        # over a CSV whose peak row read 4.715 (4.71 at two decimals)
        used = round((vm.total - vm.available) / GIB, 3)
        self.peak_gib = max(self.peak_gib, used)
        f.write(f"{time.monotonic() - start:.1f},{used:.3f},{vm.available / GIB:.3f}\n")
        f.flush()

    def _run(self) -> None:
        start = time.monotonic()
        with open(self.out, "w") as f:
            f.write("seconds,used_gib,available_gib\n")
            while True:
                self._sample(f, start)
                if self._stop.wait(self.interval_s):
                    self._sample(f, start)
                    return

    def __enter__(self) -> "MemorySampler":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def peak_from_csv(path: Path) -> float | None:
    """The peak used GiB of a sampler's CSV; None where the file is missing or has no rows."""
    try:
        rows = Path(path).read_text().splitlines()[1:]
    except OSError:
        return None
    values = [float(r.split(",")[1]) for r in rows if r.count(",") == 2]
    return max(values) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the CSV to write")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--pid", type=int, help="sample until this process exits (instead of running a command)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run and sample")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if bool(command) == bool(args.pid):
        p.error("give a command after -- or --pid, not both")
    rc = 0
    with MemorySampler(Path(args.out), args.interval) as sampler:
        if command:
            rc = subprocess.call(command)
        else:
            try:
                psutil.Process(args.pid).wait()
            except psutil.NoSuchProcess:
                pass
    print(f"machine peak: {sampler.peak_gib:.2f} GiB used of {psutil.virtual_memory().total / GIB:.2f} "
          f"(samples in {args.out})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
