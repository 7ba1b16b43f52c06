"""A resumable, deterministic batch sampler.

The order of epoch e is a permutation drawn from (seed, e) alone, so a restored sampler reproduces it without any
saved permutation; `position` counts samples consumed in the current epoch. A batch that ends an epoch moves the
state to (epoch + 1, 0) at once, so a checkpoint taken exactly at an epoch edge resumes at the first batch of the
next epoch: nothing is repeated or skipped (verl issue #5725 repeats an epoch there).
"""
from __future__ import annotations

import numpy as np


class StatefulSampler:
    """Yields lists of row indices, `batch_size` at a time, epoch after epoch.

    drop_last=True drops an epoch's final short batch (the rows come back, reshuffled, next epoch);
    drop_last=False yields it short.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if num_rows < 1:
            raise ValueError(f"num_rows={num_rows} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if drop_last and batch_size > num_rows:
            raise ValueError(f"data.train_batch_size={batch_size} > the {num_rows} prompts of data.train_files left "
                             "after data.train_max_samples and prompt-length filtering: no batch fits; lower "
                             "data.train_batch_size, raise data.max_prompt_length or add data")
        self.num_rows, self.batch_size = num_rows, batch_size
        self.seed, self.shuffle, self.drop_last = int(seed), shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, None

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch` (a pure function of seed and epoch)."""
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next_batch(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
        end = min(self.position + self.batch_size, self.num_rows)
        batch = self._order[self.position:end].tolist()
        self.position = end
        if self.num_rows - self.position < (self.batch_size if self.drop_last else 1):
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def epoch_batches(self):
        """The remaining batches of the current epoch (for `for batch in sampler.epoch_batches()` loops)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restore (epoch, position, seed). The data and batching must match what the state was saved with."""
        for key in ("epoch", "position", "seed"):
            if key not in state:
                raise KeyError(f"sampler state: missing key {key!r} (have {sorted(state)})")
        for key in ("num_rows", "batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state: {key}={state[key]!r} was saved but this sampler has {key}={getattr(self, key)!r}; "
                    "resuming over different data or batching would repeat or skip samples"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_rows:
            raise ValueError(f"sampler state: epoch={epoch}, position={position} out of range for {self.num_rows} rows")
        self.epoch, self.position, self.seed = epoch, position, int(state["seed"])
        self._order_epoch = -1
