"""YAML loading: a key written twice in one mapping is an error naming the file, the dotted key and both lines."""
import re

import pytest

from megatron_ppo.config import CONFIG_DIR, load_config
from megatron_ppo.config import ConfigError, yaml_load



def test_duplicate_key_in_a_config_file_names_file_key_and_both_lines(tmp_path):
    text = (CONFIG_DIR / "tiny_cpu.yaml").read_text().replace("  clip_ratio: 0.2\n",
                                                              "  clip_ratio: 0.2\n  clip_ratio: 0.5\n")
    lines = text.splitlines()
    first, second = [i + 1 for i, line in enumerate(lines) if line.strip().startswith("clip_ratio:")]
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    assert f"actor.clip_ratio: duplicate key at lines {first} and {second}" in message
    assert "cannot parse" not in message  # not wrapped in a second, vaguer error


def test_duplicate_keys_at_any_depth_all_reported():
    text = "a:\n  b: 1\n  c:\n    - {x: 1, x: 2}\n  b: 3\nd: 1\nd: 2\n"
    with pytest.raises(ConfigError) as err:
        yaml_load(text, source="some.yaml")
    assert err.value.errors == [  # in file order of the repeat
        "a.c[0].x: duplicate key at lines 4 and 4 (YAML would silently keep only the last; remove one)",
        "a.b: duplicate key at lines 2 and 5 (YAML would silently keep only the last; remove one)",
        "d: duplicate key at lines 6 and 7 (YAML would silently keep only the last; remove one)",
    ]
    assert "(some.yaml)" in str(err.value)


def test_same_key_in_different_mappings_and_merge_keys_are_fine():
    text = "base: &b {lr: 1}\nactor: {<<: *b, lr: 2}\ncritic: {lr: 3}\nx: {'1': a, 1: b}\n"
    assert yaml_load(text) == {"base": {"lr": 1}, "actor": {"lr": 2}, "critic": {"lr": 3}, "x": {"1": "a", 1: "b"}}
    assert yaml_load("") is None


def test_duplicate_key_in_an_override_value():
    with pytest.raises(ConfigError, match=re.escape("actor.model.arch.rope_scaling.k: duplicate key")):
        load_config("tiny_cpu", ["actor.model.arch.rope_scaling={k: 1, k: 2}"])
