"""Reward functions by data_source, verl-style: fn(solution_str, ground_truth, extra_info=None, **kwargs) -> float.

    @register_reward("my_org/my_dataset")
    def my_reward(solution_str, ground_truth, extra_info=None, **kwargs) -> float: ...

A function may also return a dict with a "score" key (as verl allows). Built-in: "openai/gsm8k".
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable

from megatron_ppo.errors import UsageError

RewardFn = Callable[..., float]
_REGISTRY: dict[str, RewardFn] = {}
_BUILTINS_LOADED = False


class UnknownDataSourceError(UsageError, LookupError):
    """No reward function is registered for a row's data_source."""


def register_reward(*data_sources: str, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function for one or more data_source names."""
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source name")

    def wrap(fn: RewardFn) -> RewardFn:
        for name in data_sources:
            if name in _REGISTRY and _REGISTRY[name] is not fn and not overwrite:
                raise ValueError(f"data_source {name!r} already has reward {_REGISTRY[name].__module__}."
                                 f"{_REGISTRY[name].__qualname__}; pass overwrite=True to replace it")
            _REGISTRY[name] = fn
        return fn

    return wrap


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        importlib.import_module("megatron_ppo.rewards.gsm8k")


def get_reward_fn(data_source: str) -> RewardFn:
    _load_builtins()
    try:
        return _REGISTRY[data_source]
    except KeyError:
        raise UnknownDataSourceError(
            f"no reward function registered for data_source {data_source!r}; registered: "
            f"{registered_data_sources()} (add one with @megatron_ppo.rewards.register_reward({data_source!r}))"
        ) from None


def registered_data_sources() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def load_custom_reward_fn(path: str | Path, name: str = "compute_score") -> Callable:
    """Import a user's Python file and return its function `name` (verl's custom_reward_function.path / .name).

    The function has verl's signature fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict.
    Any @register_reward decorators in the file run too, so one file can also add registry entries.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"custom_reward_function.path: {path} not found")
    module_name = f"megatron_ppo_user_reward_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:  # import each file once, so its @register_reward decorators run once
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    fn = getattr(module, name, None)
    if not callable(fn):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom_reward_function.name: {path} has no function {name!r}; it defines {public}")
    return fn
