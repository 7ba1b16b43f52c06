"""rollout.stop_pattern: a response ends at the first token whose text completes a match (rollout/stop.py), checked
against a plain linear scan over prefixes, on the project's real GSM8K tokenizer."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_ppo.data.tokenizer import gsm8k_tokenizer
from megatron_ppo.rollout.stop import ResponseStop, compile_stop_pattern

MARKER_LINE = r"####[^\n]*\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return gsm8k_tokenizer(tmp_path_factory.getbasetemp() / "tokenizer-cache")


def linear_stop_length(tok, regex, tokens):
    """The reference: the first prefix length whose decoded text contains a match."""
    for k in range(1, len(tokens) + 1):
        if regex.search(tok.decode(tokens[:k], skip_special_tokens=True)):
            return k
    return None


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_looping_answer_ends_with_its_first_marker_line(tok):
    stop = ResponseStop(MARKER_LINE, tok)
    text = "She has 3 + 4 = 7 eggs.\n#### 7\n#### 7\n#### 7\n#### 7"
    tokens = ids(tok, text)
    k = stop.stop_length(tokens)
    assert k is not None and k < len(tokens)
    kept = tok.decode(tokens[:k], skip_special_tokens=True)
    assert kept.startswith("She has 3 + 4 = 7 eggs.\n#### 7\n") and kept.count("####") == 1
    assert k == linear_stop_length(tok, stop.regex, tokens)


def test_no_match_no_stop(tok):
    stop = ResponseStop(MARKER_LINE, tok)
    assert stop.stop_length(ids(tok, "The answer is 7.\n#### 7")) is None  # the marker line never ends
    assert stop.stop_length([]) is None


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.sampled_from(["#### 12\n", "####", " 5", "\n", "so ", "18", " eggs", ".", "$", "##"]),
                       min_size=1, max_size=14),
       pattern=st.sampled_from([MARKER_LINE, r"\d\d", r"eggs\.", r"#### \$?\d+"]))
def test_stop_length_is_the_first_matching_prefix(tok, pieces, pattern):
    stop = ResponseStop(pattern, tok)
    tokens = ids(tok, "".join(pieces))
    assert stop.stop_length(tokens) == linear_stop_length(tok, stop.regex, tokens)


def test_apply_cuts_pads_and_zeroes_after_the_stop(tok):
    stop = ResponseStop(MARKER_LINE, tok)
    texts = ["3 + 4 = 7\n#### 7\n#### 7\n#### 7", "no marker here, 7", "#### 9\n"]
    rows = [ids(tok, t) for t in texts]
    width, pad = max(map(len, rows)) + 2, 0
    responses = torch.full((3, width), pad, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    log_probs = torch.zeros(3, width)
    rng = np.random.default_rng(0)
    for i, r in enumerate(rows):
        responses[i, :len(r)] = torch.tensor(r)
        log_probs[i, :len(r)] = torch.tensor(-rng.exponential(size=len(r)), dtype=torch.float32)
    before = (responses.clone(), lengths.clone(), log_probs.clone())
    out, out_lengths, out_lp, stopped = stop.apply(responses, lengths, log_probs, pad)
    cut = stop.stop_length(rows[0])
    assert stopped.tolist() == [True, False, True]
    assert out_lengths.tolist() == [cut, len(rows[1]), len(rows[2])]  # row 2's match ends at its last token
    assert out[0, :cut].tolist() == rows[0][:cut] and (out[0, cut:] == pad).all()
    assert torch.equal(out_lp[0, :cut], log_probs[0, :cut]) and (out_lp[0, cut:] == 0).all()
    assert torch.equal(out[1:], responses[1:]) and torch.equal(out_lp[1:], log_probs[1:])
    for a, b in zip((responses, lengths, log_probs), before):  # the engine's tensors are left as they were
        assert torch.equal(a, b)


def test_only_tokens_before_the_length_are_read(tok):
    """Padding after a response (an eos-ended row) must not make a match."""
    stop = ResponseStop(r"\d", tok)
    digits = ids(tok, "7")
    words = ids(tok, "so eggs")
    responses = torch.tensor([words + digits])
    out, lengths, _, stopped = stop.apply(responses, torch.tensor([len(words)]), torch.zeros(1, responses.shape[1]), 0)
    assert not stopped[0] and lengths.tolist() == [len(words)]


@pytest.mark.parametrize("pattern, message", [("(", "not a valid regular expression"), ("a*", "matches empty text"),
                                              (r"\n?", "matches empty text")])
def test_bad_patterns_are_refused_by_name(pattern, message):
    with pytest.raises(ValueError, match=message) as err:
        compile_stop_pattern(pattern)
    assert "rollout.stop_pattern" in str(err.value)
