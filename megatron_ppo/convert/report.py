"""What a conversion reports: wall time, peak memory (sampled by a thread while it runs), the ledger summary,
and the table printed at the end.

Memory is the proof that conversion streams: peak RSS minus the RSS before the piece loop is what the conversion
itself held (about one layer, plus on the HF side the safetensors shard being filled).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ConversionReport:
    direction: str
    out_dir: str
    seconds: float
    peak_rss_bytes: int  # sampled while converting (after imports)
    peak_anon_rss_bytes: int  # the same without file-backed (memory-mapped) pages
    baseline_rss_bytes: int  # RSS when the piece loop started
    baseline_anon_rss_bytes: int
    largest_piece_bytes: int  # the biggest unit held at once (a layer, the embedding, or an HF shard + a layer)
    ledger: dict
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def rss_text() -> str:
    import psutil

    info = psutil.Process().memory_info()
    return f"RSS {fmt_bytes(info.rss)} (file-backed/shared {fmt_bytes(info.shared)})"


class RssSampler:
    """Peak resident set size of this process while a block runs (a thread samples it every ``interval`` s).

    ``baseline`` is the RSS on entry, after the imports: peak - baseline is what the conversion itself held.
    ``peak_anon`` leaves out file-backed pages (memory-mapped safetensors), which the kernel can drop at will.
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.baseline = self.baseline_anon = self.peak = self.peak_anon = 0
        self._stop = None

    def _sample(self, proc) -> None:
        info = proc.memory_info()
        self.peak = max(self.peak, info.rss)
        self.peak_anon = max(self.peak_anon, info.rss - info.shared)

    def __enter__(self):
        import threading

        import psutil

        self._proc = psutil.Process()
        info = self._proc.memory_info()
        self.baseline, self.baseline_anon = info.rss, info.rss - info.shared
        self._sample(self._proc)
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(self.interval):
                self._sample(self._proc)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample(self._proc)


def print_table(table) -> None:
    from rich.console import Console

    Console(width=110).print(table)


def fmt_bytes(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def report_rows(report: ConversionReport, rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return rows + [
        ("time", f"{report.seconds:.1f} s"),
        ("memory", f"peak RSS {fmt_bytes(report.peak_rss_bytes)} = {fmt_bytes(report.baseline_rss_bytes)} before "
                   f"converting + {fmt_bytes(report.peak_rss_bytes - report.baseline_rss_bytes)} "
                   f"(anonymous: +{fmt_bytes(report.peak_anon_rss_bytes - report.baseline_anon_rss_bytes)}); "
                   f"largest piece held "
                   f"{fmt_bytes(report.largest_piece_bytes)}"),
        ("output", report.out_dir),
    ]
