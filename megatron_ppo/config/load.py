"""The front door: `load_config` = read YAML -> apply overrides -> build (unknown keys, types) -> validate.

    cfg = load_config("tiny_cpu", ["actor.clip_ratio=0.3", "algorithm.kl_ctrl.type=adaptive"])

Every problem raises one `ConfigError` whose message names the full dotted key (see docs/config.md). This module
only composes the others (io: YAML and building, verl_compat: verl's renames, checks: value rules), so none of
them needs to import another's caller.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .checks import validate
from .io import ConfigError, apply_overrides, from_dict, to_dict, yaml_dump, yaml_load
from .schema import PPOConfig
from .verl_compat import VERL_RENAMES

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"  # <repo>/configs, beside the package


def resolve_config_path(path_or_name: str | Path) -> Path:
    """A file path, or a bare name like "tiny_cpu" that names configs/<name>.yaml in the repository."""
    path = Path(path_or_name)
    if path.suffix in (".yaml", ".yml") or path.exists() or len(path.parts) > 1:
        if path.is_dir():
            yamls = sorted(p.name for p in path.glob("*.y*ml"))
            raise ConfigError([f"--config {str(path)!r} is a directory, not a YAML file"
                               + (f"; it holds {', '.join(yamls[:8])}" if yamls else "")])
        if not path.is_file():
            raise ConfigError([f"config file {str(path)!r} does not exist"])
        return path
    candidate = CONFIG_DIR / f"{path_or_name}.yaml"
    if not candidate.is_file():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError([f"no config named {str(path_or_name)!r}; shipped configs: {', '.join(names)}"])
    return candidate


def config_from_dict(data: Any, overrides: list[str] = (), source: str | None = None) -> PPOConfig:
    """Plain data (as from YAML) + overrides -> validated PPOConfig."""
    data = apply_overrides(data or {}, list(overrides), PPOConfig, VERL_RENAMES, source)
    cfg = from_dict(PPOConfig, data, VERL_RENAMES, source)
    validate(cfg, source)
    return cfg


def load_config(path_or_name: str | Path = "tiny_cpu", overrides: list[str] = ()) -> PPOConfig:
    """Read a YAML config (file path or shipped name), apply `a.b=value` overrides, build and validate."""
    path = resolve_config_path(path_or_name)
    source = str(path) + (f" + {len(overrides)} override(s)" if overrides else "")
    try:
        data = yaml_load(path.read_text(), source=str(path))
    except ConfigError:  # a duplicate key, already naming the file and both lines
        raise
    except Exception as exc:  # yaml.YAMLError or a decode error: name the file
        raise ConfigError([f"cannot parse YAML: {_yaml_problem(exc)}"], str(path)) from exc
    return config_from_dict(data, overrides, source)


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's multi-line message -> 'line L, column C: problem (context)'."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    context = getattr(exc, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def to_yaml(cfg: PPOConfig) -> str:
    return yaml_dump(to_dict(cfg))


def save_config(cfg: PPOConfig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(to_yaml(cfg))
