"""``rollout.stop_pattern``: end a response where its text first matches a regular expression.

Why: a task's answer format can end an answer before the model's eos does. On GSM8K, SmolLM2 trained with PPO writes
its ``#### N`` line and then repeats it to the length limit; those repeats are sampled, scored and trained on. With
``rollout.stop_pattern: '####[^\\n]*\\n'`` a response ends with the line that holds its marker.

How: applied to every online batch after the engine returns it (training, validation, ``megatron-ppo eval``), so it
is the same for every engine. The response keeps the fewest leading tokens whose decoded text (as the reward reads
it: ``skip_special_tokens=True``) contains a match; the tokens after it become padding, their log-probs 0. Token
``k`` never depends on tokens after it, so this equals stopping the decode loop there, except that the engine still
spent the compute on the dropped tokens. A stopped response counts as ended (like eos), not as clipped.

Unlike vLLM's ``stop`` strings the match stays in the response (the policy is trained on the tokens it sampled),
and it is a regular expression, so ``#### <number><newline>`` can be said. A pattern must not match empty text (it
would end every response after one token): the config check refuses it.
"""
from __future__ import annotations

import re

import torch


def compile_stop_pattern(pattern: str) -> re.Pattern:
    """The compiled pattern, or ValueError naming rollout.stop_pattern (bad syntax, or it matches empty text)."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"rollout.stop_pattern={pattern!r}: not a valid regular expression ({exc})") from exc
    if regex.search("") is not None:
        raise ValueError(f"rollout.stop_pattern={pattern!r}: matches empty text, so every response would end after "
                         "its first token; make it require at least one character (e.g. '####[^\\n]*\\n')")
    return regex


class ResponseStop:
    """Cuts responses at the first match of ``pattern`` in their decoded text (module docstring)."""

    def __init__(self, pattern: str, tokenizer):
        self.regex = compile_stop_pattern(pattern)
        self.tokenizer = tokenizer

    @classmethod
    def from_config(cls, rollout_cfg, tokenizer) -> "ResponseStop | None":
        return cls(rollout_cfg.stop_pattern, tokenizer) if rollout_cfg.stop_pattern else None

    def _matches(self, tokens: list[int]) -> bool:
        return self.regex.search(self.tokenizer.decode(tokens, skip_special_tokens=True)) is not None

    def stop_length(self, tokens: list[int]) -> int | None:
        """The fewest leading tokens of ``tokens`` whose text contains a match; None when the whole has none.

        Binary search (a prefix's text is a prefix of the longer text's, so "contains a match" only turns on), then
        a linear walk down for the rare text where a later token rewrites an earlier character (a split UTF-8
        sequence), so the length returned is always the smallest whose text matches."""
        if not tokens or not self._matches(tokens):
            return None
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._matches(tokens[:mid]):
                hi = mid
            else:
                lo = mid + 1
        while lo > 1 and self._matches(tokens[:lo - 1]):
            lo -= 1
        return lo

    def apply(self, responses: torch.Tensor, lengths: torch.Tensor, log_probs: torch.Tensor,
              pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(responses, lengths, log_probs, stopped [B] bool) with every response cut after its first match;
        new tensors, the inputs are left as they were."""
        responses, lengths, log_probs = responses.clone(), lengths.clone(), log_probs.clone()
        stopped = torch.zeros(responses.shape[0], dtype=torch.bool)
        for row in range(responses.shape[0]):
            n = int(lengths[row])
            cut = self.stop_length(responses[row, :n].tolist())
            if cut is None or cut == n:
                stopped[row] = cut is not None
                continue
            responses[row, cut:] = pad_token_id
            log_probs[row, cut:] = 0.0
            lengths[row] = cut
            stopped[row] = True
        return responses, lengths, log_probs, stopped
