"""trainer.components.Components is built by name: a positional build (which silently swaps two fields of the
same type, e.g. ref and critic) is refused."""
import dataclasses

import pytest

from megatron_ppo.trainer.components import Components


def test_components_take_keyword_arguments_only():
    names = [f.name for f in dataclasses.fields(Components)]
    with pytest.raises(TypeError, match="positional"):
        Components(*[None] * len(names))
    parts = Components(**{name: None for name in names})
    assert all(getattr(parts, name) is None for name in names)
