"""Host reads outside generation (issue 47): a worker's forward and train step read nothing back per layer and at most
a few values per micro-batch, whatever the depth; the value checks read their verdicts once per call and still fail
with the same error. Counted by ``testing.host_reads.HostReadCounter`` (each read is a stream drain on a GPU).
Real megatron-core, one rank; tools/bench_host_reads.py measures a whole PPO step (docs/bench/host_reads.md)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ppo.algo import checks
from megatron_ppo.testing.host_reads import HostReadCounter

VOCAB = 512
OPTIM = SimpleNamespace(lr=1e-2, weight_decay=0.0, betas=[0.9, 0.999], clip_grad=1.0, lr_warmup_steps=0,
                        lr_warmup_steps_ratio=0.0, lr_warmup_init=0.0, lr_decay_steps=None,
                        lr_decay_style="constant", min_lr=0.0)


def test_counter_counts_each_kind_of_read_once():
    x = torch.arange(6.0)
    with HostReadCounter() as reads:
        bool(x.any()), x.tolist(), int(x[-1]), float(x.sum()), torch.equal(x, x), x.max().item()
        x[x > 2]  # a boolean index is a nonzero: a read
        x[1:3], x + 1  # not reads
        with reads.paused():
            x.tolist()
    assert reads.by_name == {"__bool__": 1, "tolist": 1, "__int__": 1, "__float__": 1, "equal": 1, "item": 1,
                             "__getitem__": 1}
    with HostReadCounter(start_paused=True) as reads:
        x.tolist()
        with reads.resumed():
            x.tolist()
    assert reads.total == 1


def test_deferred_checks_read_once_and_fail_the_same():
    good, bad = torch.ones(4), torch.tensor([1.0, float("nan"), 1.0, 1.0])
    with HostReadCounter() as reads, checks.deferred():
        for _ in range(5):
            checks.finite(good, "log_prob")
            checks.index_range(torch.tensor([0, 3]), "targets", 0, 4)
    assert reads.total == 1
    with pytest.raises(ValueError, match="log_prob has 1 NaN/inf values"):
        with checks.deferred():
            checks.finite(good, "old_log_prob")
            checks.finite(bad, "log_prob")
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 4\), got \[0, 4\]"):
        checks.index_range(torch.tensor([0, 4]), "targets", 0, 4)  # outside a deferred block: at once


def _micro_batches():
    from megatron_ppo.models.forward import pack_sequences

    g = torch.Generator().manual_seed(3)
    out = []
    for lens in ((23, 9, 17), (5, 30)):
        ids, cu = pack_sequences([torch.randint(0, VOCAB, (n,), generator=g) for n in lens])
        out.append({"input_ids": ids, "cu_seqlens": cu, "seq_bounds": tuple(cu.tolist())})
    return out


def _loss(logits, micro):
    from megatron_ppo.models.logprobs import next_token_targets, vocab_parallel_logprobs_entropy

    targets, valid = next_token_targets(micro["input_ids"], micro["cu_seqlens"])
    logp, ent = vocab_parallel_logprobs_entropy(logits, targets, vocab_size=VOCAB)
    checks.finite(logp, "log_prob", valid)
    loss = -(logp * valid).sum() / valid.sum()
    return loss, {"nll": loss.detach(), "entropy": (ent * valid).sum().detach()}


def _reads(layers: int, role: str) -> tuple[int, int, dict]:
    """(reads in a train step, reads in a forward, where they were) of a fresh worker after one warm-up step."""
    from megatron_ppo import parallel
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    parallel.seed_everything(7)
    worker = MegatronWorker(role, tiny_arch(num_layers=layers), optim=OPTIM)
    if role == "critic":
        def loss_fn(values, micro):
            loss = values.float().pow(2).mean()
            return loss, {"v": loss.detach()}

        def output_fn(values, micro):
            return {"v": values}
    else:
        loss_fn, output_fn = _loss, (lambda logits, micro: {"lp": logits[..., :4]})
    worker.train_step(_micro_batches(), loss_fn)  # warm-up: first-call paths
    with HostReadCounter(where=True) as train:
        worker.train_step(_micro_batches(), loss_fn)
    with HostReadCounter(where=True) as forward:
        worker.forward(_micro_batches(), output_fn)
    return train.total, forward.total, {**train.sites, **forward.sites}


def test_worker_reads_do_not_grow_with_depth(megatron_single):
    """The actor (the critic runs the same layers; its value head reads nothing)."""
    shallow, deep = _reads(2, "actor"), _reads(4, "actor")
    assert shallow[:2] == deep[:2], f"2 layers: {shallow}\n4 layers: {deep}"
    train, forward, sites = deep
    n = len(_micro_batches())
    assert train <= 8 * n, sites  # the budget: at most 8 per micro-batch forward + backward
    assert forward <= 2, sites  # the deferred checks' verdicts (none here) and nothing else
