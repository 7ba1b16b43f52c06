"""Plumbing between typed config dataclasses and YAML / CLI text, kept apart from the schema (`config.schema`).

Building is strict: every key must be a declared field, every value must match the field's type hint (Literal
values are the allowed set), and every error names the full dotted key. Errors are collected, not raised one by
one, so a user fixing a config sees all problems at once.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from megatron_ppo.errors import UsageError


class ConfigError(UsageError):
    """Every config problem: unknown key, wrong type, bad value. `errors` holds one line per problem."""

    def __init__(self, errors: list[str], source: str | None = None):
        self.errors = list(errors)
        where = f" ({source})" if source else ""
        if len(self.errors) == 1:
            message = f"invalid config{where}: {self.errors[0]}"
        else:
            message = f"invalid config{where}, {len(self.errors)} problems:\n  - " + "\n  - ".join(self.errors)
        super().__init__(message)


# ---------------------------------------------------------------------------------------------- YAML

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` / `3e4` as floats (YAML 1.1 wants `1.0e-6`; a classic lr gotcha)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_load(text: str, source: str | None = None) -> Any:
    """One YAML document, refusing duplicate mapping keys (PyYAML would silently keep the last one, so a
    `clip_ratio: 0.2` further down a file could be overridden by a forgotten `clip_ratio: 0.5`).

    `source` (a file name) is named in the error. Raises ConfigError for a duplicate key, yaml.YAMLError for
    malformed YAML.
    """
    loader = _Loader(text)  # a SafeLoader subclass
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        duplicates = _duplicate_keys(node, "")
        if duplicates:
            raise ConfigError(duplicates, source)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _duplicate_keys(node: yaml.Node, prefix: str) -> list[str]:
    """`dotted.key: duplicate key at lines A and B` for every scalar key repeated in one mapping, at any depth."""
    problems = []
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            child = prefix
            if isinstance(key_node, yaml.ScalarNode):
                child = f"{prefix}{key_node.value}"
                ident, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if ident in first_line and key_node.value != "<<":  # `<<` is YAML's merge key, not data
                    problems.append(f"{child}: duplicate key at lines {first_line[ident]} and {line} "
                                    "(YAML would silently keep only the last; remove one)")
                first_line.setdefault(ident, line)
            problems += _duplicate_keys(value_node, child + ".")
    elif isinstance(node, yaml.SequenceNode):
        base = prefix.rstrip(".")
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, f"{base}[{i}].")
    return problems


def yaml_dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


# ---------------------------------------------------------------------------------------------- schema walking

@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _unwrap_optional(tp: Any) -> Any:
    """Optional[X] -> X; anything else unchanged."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass tree (sections included), for suggestions."""
    keys = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        inner = _unwrap_optional(_hints(cls)[f.name])
        if dataclasses.is_dataclass(inner):
            keys += schema_keys(inner, key + ".")
    return keys


def _suggest(key: str, section_fields: list[str], all_keys: list[str], renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        if key == old or key.startswith(old + "."):
            target = (new + key[len(old):]).lstrip(".")
            if target in all_keys or any(k.startswith(target + ".") for k in all_keys):
                return f"; verl calls it {key!r}, here it is {target!r}"
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, section_fields, n=1, cutoff=0.6)
    if close:
        parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
        return f"; did you mean {parent + close[0]!r}?"
    elsewhere = [k for k in all_keys if k.rsplit(".", 1)[-1] == leaf]
    if elsewhere:
        return f"; {leaf!r} exists as {', '.join(repr(k) for k in elsewhere)}"
    close = difflib.get_close_matches(key, all_keys, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list of ({type_name(get_args(tp)[0])})"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------------------------------------- building

class _Builder:
    def __init__(self, root: type, renames: list[tuple[str, str]]):
        self.errors: list[str] = []
        self.all_keys = schema_keys(root)
        self.renames = renames

    def build(self, cls: type, data: Any, prefix: str, base: Any = None) -> Any:
        """Keys missing from `data` keep the value in `base` (the section's default instance), so a partial
        `critic.optim: {clip_grad: 0.5}` keeps critic's own lr default rather than OptimConfig's."""
        label = prefix.rstrip(".") or "<root>"
        if not isinstance(data, dict):
            self.errors.append(f"{label}: expected a mapping, got {type(data).__name__} {data!r}")
            return None
        names = [f.name for f in dataclasses.fields(cls)]
        hints = _hints(cls)
        for key in data:
            if not isinstance(key, str):
                self.errors.append(f"{prefix}{key!r}: keys must be strings")
            elif key not in names:
                full = prefix + key
                hint = _suggest(full, names, self.all_keys, self.renames)
                self.errors.append(f"{full}: unknown key{hint}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            default = copy.deepcopy(getattr(base, f.name)) if base is not None else _default(f)
            if f.name in data:
                sub_base = default if dataclasses.is_dataclass(default) else None
                value = self.convert(data[f.name], hints[f.name], prefix + f.name, sub_base)
                if value is not _INVALID:
                    kwargs[f.name] = value
            elif default is dataclasses.MISSING:
                self.errors.append(f"{prefix}{f.name}: required key is missing")
            else:
                kwargs[f.name] = default
        try:
            return cls(**kwargs)
        except TypeError:  # a required field was reported missing or invalid above
            return None

    def convert(self, value: Any, tp: Any, key: str, base: Any = None) -> Any:
        origin = get_origin(tp)
        if tp is Any:
            return value
        if origin in (Union, types.UnionType):
            return self._union(value, tp, key, base)
        if value is None:
            return self._bad(key, tp, value)
        if origin is Literal:
            if any(value == a and type(value) is type(a) for a in get_args(tp)):
                return value
            allowed = ", ".join(repr(a) for a in get_args(tp))
            self.errors.append(f"{key}: must be one of [{allowed}], got {value!r}")
            return _INVALID
        if dataclasses.is_dataclass(tp):
            built = self.build(tp, value, key + ".", base)
            return _INVALID if built is None else built
        if origin is list:
            item = get_args(tp)[0]
            if isinstance(value, str) and item is str:
                value = [value]  # verl accepts `train_files: a.parquet` as well as a list
            if not isinstance(value, list):
                return self._bad(key, tp, value)
            items = [self.convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
            return _INVALID if any(v is _INVALID for v in items) else items
        if origin is dict:
            if not isinstance(value, dict):
                return self._bad(key, tp, value)
            return copy.deepcopy(value)
        if tp is bool:
            return value if isinstance(value, bool) else self._bad(key, tp, value)
        if tp is int:
            return value if isinstance(value, int) and not isinstance(value, bool) else self._bad(key, tp, value)
        if tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            return self._bad(key, tp, value)
        if tp is str:
            return value if isinstance(value, str) else self._bad(key, tp, value)
        raise TypeError(f"config schema: unsupported type {tp!r} at {key}")  # a bug in the schema, not user input

    def _union(self, value: Any, tp: Any, key: str, base: Any) -> Any:
        args = get_args(tp)
        if value is None:
            return None if type(None) in args else self._bad(key, tp, value)
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return self.convert(value, options[0], key, base)
        for option in options:
            trial = _Builder.__new__(_Builder)
            trial.errors, trial.all_keys, trial.renames = [], self.all_keys, self.renames
            out = trial.convert(value, option, key)
            if not trial.errors:
                return out
        return self._bad(key, tp, value)

    def _bad(self, key: str, tp: Any, value: Any) -> Any:
        shown = "null" if value is None else f"{type(value).__name__} {value!r}"
        self.errors.append(f"{key}: expected {type_name(tp)}, got {shown}")
        return _INVALID


_INVALID = object()


def from_dict(cls: type, data: Any, renames: list[tuple[str, str]] = (), source: str | None = None) -> Any:
    """Build a dataclass tree from plain data; raise ConfigError listing every unknown key and type error."""
    builder = _Builder(cls, list(renames))
    obj = builder.build(cls, {} if data is None else data, "")
    if builder.errors:
        raise ConfigError(builder.errors, source)
    return obj


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


# ---------------------------------------------------------------------------------------------- overrides

def _field_type(cls: type, parts: list[str]) -> tuple[Any, str | None]:
    """Type of the field at a dotted path, or (None, error). Keys below a dict-typed field are free-form."""
    tp: Any = cls
    for depth, part in enumerate(parts):
        inner = _unwrap_optional(tp)
        if get_origin(inner) is dict or inner is Any:
            return Any, None
        if not dataclasses.is_dataclass(inner):
            return None, f"{'.'.join(parts[:depth])} is a {type_name(tp)}, it has no key {part!r}"
        hints = _hints(inner)
        if part not in hints:
            return None, "unknown"
        tp = hints[part]
    return tp, None


YAML_NULLS = ("", "null", "Null", "NULL", "~")  # the plain scalars YAML reads as null


def apply_overrides(
    data: dict, overrides: list[str], cls: type, renames: list[tuple[str, str]] = (), source: str | None = None
) -> dict:
    """Return a copy of `data` with `a.b.c=value` overrides applied; values are YAML scalars/flow collections.

    A value for a string field is kept verbatim (so `trainer.experiment_name=2024` stays a string, and
    `rollout.stop_pattern=####...` is not a YAML comment), unless it is null; all other
    values are type-checked later by `from_dict`, with the same error messages as the YAML file gets.
    """
    data = copy.deepcopy(data) if data else {}
    errors = []
    all_keys = schema_keys(cls)
    skip = False
    for i, text in enumerate(overrides):
        if skip:
            skip = False
            continue
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep and key and i + 1 < len(overrides) and "=" not in overrides[i + 1] and \
                _field_type(cls, key.split("."))[1] is None:  # `key value`, as a shell habit: one hint for both
            errors.append(f"override {text!r} {overrides[i + 1]!r}: expected dotted.key=value without spaces: "
                          f"{key}={overrides[i + 1]}")
            skip = True
            continue
        if not sep or not key or any(not p for p in key.split(".")):
            errors.append(f"override {text!r}: expected dotted.key=value")
            continue
        parts = key.split(".")
        tp, problem = _field_type(cls, parts)
        if problem == "unknown":
            parent = ".".join(parts[:-1])
            section = _field_type(cls, parts[:-1])[0] if parent else cls
            inner = _unwrap_optional(section)
            names = [f.name for f in dataclasses.fields(inner)] if dataclasses.is_dataclass(inner) else []
            errors.append(f"override {text!r}: {key}: unknown key{_suggest(key, names, all_keys, list(renames))}")
            continue
        if problem:
            errors.append(f"override {text!r}: {problem}")
            continue
        try:
            value = yaml_load(raw) if raw.strip() else None
        except ConfigError as exc:  # a flow mapping with a repeated key
            inner = exc.errors[0]
            errors.append(f"override {text!r}: {key}{'' if inner.startswith('[') else '.'}{inner}")
            continue
        except yaml.YAMLError as exc:
            errors.append(f"override {text!r}: {key}: value is not valid YAML ({exc.__class__.__name__})")
            continue
        if get_origin(_unwrap_optional(tp)) is list and isinstance(value, str) and "," in value:
            errors.append(f"override {text!r}: {key} is a list: write it in brackets, {key}=[{value}] (a single "
                          f"value with a comma: {key}=['{value}'])")
            continue
        if _unwrap_optional(tp) is str and not isinstance(value, str) and (
                value is not None or raw.strip() not in YAML_NULLS):  # a bare '#...' is a YAML comment: None
            value = raw.strip()
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if errors:
        raise ConfigError(errors, source)
    return data
