"""Every refusal of the conversion ledger fires: a check without a test that makes it fire does not exist.

Branches: unexpected source / target, consumed twice, written twice, wrong element count, source never consumed,
target never written, parameter imbalance (with and without vocab padding), and the complete conversion passes.
"""
from __future__ import annotations

import pytest

from megatron_ppo.convert.ledger import Ledger
from megatron_ppo.convert.mapping import ConversionError


def _ledger() -> Ledger:
    """HF -> Megatron style: q, k, v fused into qkv; the embedding padded by 2 rows of 4."""
    ledger = Ledger("t")
    for name in ("q", "k", "v"):
        ledger.expect_source(name, 4, "attention")
    ledger.expect_source("embed", 12, "embedding")
    ledger.expect_target("qkv", 12, "attention")
    ledger.expect_target("word_embeddings", 20, "embedding")
    return ledger


def _complete(ledger: Ledger) -> Ledger:
    for name in ("q", "k", "v", "embed"):
        ledger.consume(name)
    ledger.write("qkv", 12)
    ledger.padding_added = 8
    ledger.write("word_embeddings", 20)
    return ledger


def test_complete_conversion_passes_and_balances():
    ledger = _complete(_ledger())
    ledger.check()
    assert ledger.summary()["params_in"] == 24 and ledger.summary()["params_out"] == 32


def test_target_never_written_is_refused():
    ledger = _ledger()
    for name in ("q", "k", "v", "embed"):
        ledger.consume(name)
    ledger.write("qkv", 12)
    with pytest.raises(ConversionError, match=r"1 target tensors never written: \['word_embeddings'\]"):
        ledger.check()


def test_target_never_written_is_refused_even_when_the_counts_balance():
    """The unwritten target is the only problem: params in == params out (nothing padded, nothing consumed for it)."""
    ledger = Ledger("t")
    ledger.expect_source("a", 4, "mlp")
    ledger.expect_target("a_out", 4, "mlp")
    ledger.expect_target("derived", 0, "other")  # an empty tensor: no parameter count can notice it missing
    ledger.consume("a")
    ledger.write("a_out", 4)
    with pytest.raises(ConversionError, match=r"never written: \['derived'\]"):
        ledger.check()


def test_source_never_consumed_is_refused():
    ledger = _ledger()
    for name in ("q", "k", "embed"):
        ledger.consume(name)
    ledger.write("qkv", 12)
    ledger.padding_added = 8
    ledger.write("word_embeddings", 20)
    with pytest.raises(ConversionError, match=r"1 source tensors never consumed: \['v'\]"):
        ledger.check()


@pytest.mark.parametrize("added, dropped", [(0, 0), (7, 0), (8, 1), (9, 0)])
def test_parameter_imbalance_is_refused(added, dropped):
    """Every tensor consumed and written once, but the counts do not balance with the declared padding."""
    ledger = _complete(_ledger())
    ledger.padding_added, ledger.padding_dropped = added, dropped
    with pytest.raises(ConversionError, match=rf"parameter count in 24 \(\+{added} padding added, -{dropped} "
                                              rf"padding dropped\) != out 32"):
        ledger.check()


def test_padding_dropped_balances_the_other_direction():
    ledger = Ledger("back")
    ledger.expect_source("word_embeddings", 20, "embedding")
    ledger.expect_target("embed", 12, "embedding")
    ledger.consume("word_embeddings")
    ledger.write("embed", 12)
    with pytest.raises(ConversionError, match="!= out 12"):
        ledger.check()
    ledger.padding_dropped = 8
    ledger.check()


def test_consumed_twice_written_twice_and_unknown_names_are_refused():
    ledger = _ledger()
    ledger.consume("q")
    with pytest.raises(ConversionError, match="t: source tensor 'q' consumed twice"):
        ledger.consume("q")
    ledger.write("qkv", 12)
    with pytest.raises(ConversionError, match="t: target tensor 'qkv' written twice"):
        ledger.write("qkv", 12)
    with pytest.raises(ConversionError, match="consumed 'nope', which is not an expected source"):
        ledger.consume("nope")
    with pytest.raises(ConversionError, match="wrote 'nope', which is not an expected target"):
        ledger.write("nope", 1)


def test_wrong_element_count_is_refused_and_not_recorded():
    ledger = _ledger()
    with pytest.raises(ConversionError, match="target 'qkv' has 11 elements, expected 12"):
        ledger.write("qkv", 11)
    ledger.write("qkv", 12)  # the refused write did not count as a write


def test_all_problems_are_reported_together():
    ledger = _ledger()
    ledger.consume("q")
    with pytest.raises(ConversionError) as err:
        ledger.check()
    assert "source tensors never consumed" in str(err.value) and "target tensors never written" in str(err.value)
