"""What the user sees: quiet library loggers, one-line errors with exit codes, the run's log file, signals.

A new user meets our messages first, so they must not be buried under Megatron's config dumps or a traceback.
  quiet()            megatron.*, Transformer-Engine/Apex fallback warnings -> off (one summary line); --verbose undoes
  ERROR_EXIT_CODES   usage/config/data errors (UsageError, megatron_ppo/errors.py) -> 2; interrupted -> 130
                     (SIGINT) / 143 (SIGTERM); anything else -> 1
  report_error()     one line on stderr; the traceback goes to the run's log file (and to the screen with --debug)
  handle_signals()   SIGINT/SIGTERM raise `Interrupted` in the main thread, so `finally` blocks remove temp dirs
  deferred_signals() holds SIGINT/SIGTERM over steps that must all happen or none (moving a set of files in)
  kill_children()    the processes this one started (multiprocessing, tokenizers, ...) are ended, none orphaned
Imports nothing heavy: it runs before torch or Megatron are loaded.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

from megatron_ppo.errors import UsageError  # noqa: F401 - re-exported: `console.UsageError` keeps working

DEBUG_ENV = "MEGATRON_PPO_DEBUG"
VERBOSE_ENV = "MEGATRON_PPO_VERBOSE"
# loggers whose INFO output is configuration dumps and bucket lists, not news for the user
NOISY_LOGGERS = ("megatron", "megatron.core", "torch.distributed", "transformer_engine", "apex", "ray", "filelock",
                 "urllib3", "httpx", "datasets")
# libraries whose WARNING lines are advice for their developers, not the run's user (transformers' tokenizer notes,
# 3 lines each, from every process that loads a tokenizer): ERROR only, unless --verbose
ADVICE_LOGGERS = ("transformers",)
# a record logged with ``extra=FILE_ONLY`` goes to the run's log file, not the screen (routine notices a user may
# want when something went wrong, e.g. how much heap the ranks gave back before a save)
FILE_ONLY = {"file_only": True}
# warnings Megatron emits when TE/Apex are absent; collapsed into one line
FALLBACK_WARNING_PATTERNS = (r".*[Tt]ransformer[ _-]?[Ee]ngine.*", r".*\bTE\b.*", r".*[Aa]pex.*",
                             r".*fused.*(kernel|layer ?norm|adam).*", r".*torch\.distributed\._.*deprecated.*")

# modules whose warnings are advice for library developers (deprecated Megatron flags, CUDA tuning hints on CPU,
# torch.distributed renames, a torch performance note raised through our CPU shims)
NOISY_WARNING_MODULES = r"(megatron|torch\.distributed|transformer_engine|apex|megatron_ppo\.parallel\.platform)(\..*)?$"

_run_log: str | None = None


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; a KeyboardInterrupt subclass so `except Exception` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false")


def verbose_enabled() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def quiet(verbose: bool | None = None) -> None:
    """Library loggers at WARNING and the TE/Apex fallback warnings off, unless verbose (or MEGATRON_PPO_VERBOSE=1).
    Safe to call in every process (driver and worker ranks) and more than once."""
    if verbose is None:
        verbose = verbose_enabled()
    if verbose:
        return
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers sets up its logger
    if "transformers.utils.logging" in sys.modules:  # set up already: it reset its level then
        sys.modules["transformers.utils.logging"].set_verbosity_error()
    for name in ADVICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for pattern in FALLBACK_WARNING_PATTERNS:
        warnings.filterwarnings("ignore", message=pattern)
    for category in (UserWarning, FutureWarning, DeprecationWarning):  # library advice meant for its developers
        warnings.filterwarnings("ignore", category=category, module=NOISY_WARNING_MODULES)
    # Megatron logs its OptimizerConfig / DDP config dumps and bucket lists at INFO from module loggers named after
    # the module (megatron.core.optimizer, megatron.core.distributed...): the "megatron" parent above covers them.


def setup_logging(verbose: bool | None = None) -> None:
    """Our own INFO lines, short; library loggers quietened (see quiet)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for handler in logging.getLogger().handlers:  # the screen's handlers only (not a file, not pytest's capture)
        if getattr(handler, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__) and \
                not any(isinstance(f, _ScreenFilter) for f in handler.filters):
            handler.addFilter(_ScreenFilter())
    quiet(verbose)


class _ScreenFilter(logging.Filter):
    """Keeps FILE_ONLY records off the screen (the run log's FileHandler still takes them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False) or verbose_enabled()


def set_run_log(path: str) -> str:
    """From here on, log records (and any traceback) also go to `path` (the run's log file)."""
    global _run_log
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    _run_log = path
    return path


def run_log() -> str | None:
    return _run_log


def fallback_log(command: str) -> str:
    """Where a traceback goes before any run log dir is known: a per-user file in the temp dir."""
    folder = os.path.join(tempfile.gettempdir(), f"megatron-ppo-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{command or 'megatron-ppo'}-last-error.log")


def is_usage_error(exc: BaseException) -> bool:
    """Config, data and input errors: what the user fixes by changing a key, a file or an argument (exit 2).
    By type only: every input error of the package subclasses UsageError (megatron_ppo/errors.py); a missing or
    unreadable path the user named is an OSError of one of these kinds."""
    return isinstance(exc, (UsageError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError))


def report_error(command: str, exc: BaseException, debug: bool | None = None) -> int:
    """One line (the exception's message; a multi-line ConfigError keeps its few lines) on stderr, the traceback
    in the run's log file (or the fallback log) and on screen only with --debug. Returns the exit code."""
    debug = debug_enabled() if debug is None else debug
    prog = f"megatron-ppo {command}".strip()
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = _run_log or fallback_log(command)
    try:
        with open(where, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {prog}\n{tb}\n")
    except OSError:
        where = None
    if isinstance(exc, Interrupted):
        code = exc.exit_code
    elif isinstance(exc, KeyboardInterrupt):
        code = 130
    else:
        code = 2 if is_usage_error(exc) else 1
    if debug:
        sys.stderr.write(tb)
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):
        name = message if isinstance(exc, Interrupted) else "SIGINT"
        text = (f"{prog}: interrupted by {name}; its child processes were stopped and its temp files removed "
                "(outputs are written atomically: nothing partial is left)")
    elif code == 2:
        text = f"{prog}: error: {message}"
    else:
        text = f"{prog}: error: {type(exc).__name__}: {message}"
    lines = text.splitlines()
    if len(lines) > 8:  # a long list (e.g. every bad key) is cut; the log has all of it
        lines = lines[:8] + [f"  ... {len(lines) - 8} more line(s)"]
    hint = "" if debug or where is None or isinstance(exc, KeyboardInterrupt) else \
        f" (traceback in {where}; --debug shows it)"
    if code == 1:
        lines[-1] += hint
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code


_received: list[int] = []


def handle_signals() -> dict:
    """SIGINT and SIGTERM raise Interrupted in the main thread, so `finally` blocks remove temp dirs and stop
    children. Each signal is also recorded (`received`): an exception raised inside an interpreter callback (e.g.
    logging's at-fork lock release) is printed as "Exception ignored" and lost, and the caller must still know.
    Returns the previous handlers (for restore_signals: `cli.main` also runs inside tests' processes)."""
    _received.clear()

    def _raise(signum, frame):
        _received.append(signum)
        raise Interrupted(signum)

    return {sig: signal.signal(sig, _raise) for sig in (signal.SIGINT, signal.SIGTERM)}


@contextlib.contextmanager
def deferred_signals():
    """SIGINT/SIGTERM arriving inside the block are held and delivered when it ends (to whatever handler was there,
    e.g. handle_signals' Interrupted): for a few steps that must all happen or none, such as moving the files of a
    set into place. Python-level (the handlers are swapped), since pthread_sigmask would only mask this thread and
    the kernel would hand the signal to another (pyarrow's, torch's). Outside the main thread: no effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


def received() -> int | None:
    """The first signal handle_signals caught, if any."""
    return _received[0] if _received else None


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def child_pids() -> set[int]:
    """This process's descendants now (a snapshot, so kill_children spares what existed before a command ran)."""
    try:
        import psutil

        return {c.pid for c in psutil.Process().children(recursive=True)}
    except Exception:  # noqa: BLE001 - psutil missing or the process table unreadable: nothing to spare
        return set()


def kill_children(timeout: float = 5.0, spare: set[int] = frozenset()) -> list[int]:
    """End every descendant of this process not in `spare` (SIGTERM, then SIGKILL after `timeout`); returns
    their pids."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return []
    try:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in spare]
    except psutil.Error:
        return []
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=timeout)
    return [c.pid for c in children]


def written_paths(cfg, log_dir: str) -> str:
    """The end-of-run summary: where everything this run wrote is (only what exists)."""
    items = [("metrics", os.path.join(log_dir, "metrics.jsonl")), ("run record", os.path.join(log_dir, "run.json")),
             ("log", os.path.join(log_dir, "train.log")), ("TensorBoard", os.path.join(log_dir, "tensorboard"))]
    if cfg.rollout.dump_dir:
        items.append(("rollouts", cfg.rollout.dump_dir))
    if cfg.trainer.save_freq > 0:
        items.append(("checkpoints", cfg.trainer.expand(cfg.trainer.default_local_dir)))
    # files other engineers' features write into the log dir (plots, run records) are listed as they appear
    known = {os.path.basename(p) for _, p in items}
    extra = sorted(n for n in (os.listdir(log_dir) if os.path.isdir(log_dir) else [])
                   if n not in known and not n.startswith("."))
    lines = ["wrote:"] + [f"  {what:<12}{path}" for what, path in items if os.path.exists(path)]
    lines += [f"  {'':<12}{os.path.join(log_dir, n)}" for n in extra]
    return "\n".join(lines)


# the per-step console line: the few metrics a user watches; every metric still goes to metrics.jsonl
STEP_SUMMARY = (("reward", ("reward/score/mean",)), ("kl", ("actor/ppo_kl", "actor/kl_loss")),
                ("pg_loss", ("actor/pg_loss",)), ("vf_loss", ("critic/vf_loss",)),
                ("resp_len", ("response_length/mean",)))
_step_clock: dict = {}


def step_parts(step: int, scalars: dict, total_steps: int | None = None) -> dict[str, str]:
    """The per-step summary as labelled parts: step ('step 3/8'), reward, kl, pg_loss, vf_loss, resp_len, time
    ('2.10 s/step'), eta ('ETA 0:00:10', from the mean step time so far). Step 0 (validation before training) is
    one 'step' part: it is not a step, and not part of the step-time clock."""
    now = time.monotonic()
    if step == 0:
        return {"step": "validation before training  " + "  ".join(
            f"{k} {v:.4g}" for k, v in sorted(scalars.items()) if k.endswith("/mean") or k.startswith("val"))[:400]}
    first = _step_clock.setdefault("first", (step, now))
    parts = {"step": f"step {step}/{total_steps}" if total_steps else f"step {step}"}
    for label, keys in STEP_SUMMARY:
        value = next((scalars[k] for k in keys if k in scalars), None)
        if value is not None:
            parts[label] = f"{label} {value:.4g}"
    step_time = scalars.get("timing/step")
    if step_time is not None:
        parts["time"] = f"{step_time:.2f} s/step"
    if total_steps and step < total_steps:
        done = step - first[0]
        per_step = (now - first[1]) / done if done > 0 else step_time
        if per_step:
            parts["eta"] = f"ETA {datetime.timedelta(seconds=round(per_step * (total_steps - step)))}"
    return parts


def step_line(step: int, scalars: dict, total_steps: int | None = None) -> str:
    """'step 3/8  reward 0.125  kl 0.0012  ...  2.1 s/step  ETA 0:00:10' (see step_parts)."""
    return "  ".join(step_parts(step, scalars, total_steps).values())
