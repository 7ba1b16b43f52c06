"""What a fresh value head reads: the final hidden-state norm of an HF model on GSM8K prompts, and the spread of the
values a head initialised as Megatron / verl do (normal(0, 0.02)) gives there, against a zero head.

Why: a critic built from a pretrained LM gets a new 1-output head on the final (normed) hidden states; its first
values are ~N(0, (0.02 * |h|)^2) per token. When that spread dwarfs the returns' (GSM8K rewards 0 / 0.1 / 1), the
whitened GAE advantages are the head's noise (docs/bench/learning_smollm2.md, session 16 notes), which is why
`critic.value_head_init=zeros` exists.

    python tools/probe_value_head.py --model models/SmolLM2-135M-Instruct --data outputs/gsm8k/data/test.parquet
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

INIT_STD = 0.02  # Megatron's init_method_std and verl's critic head


def value_spread(hidden: torch.Tensor, heads: int = 16, std: float = INIT_STD, seed: int = 0) -> dict:
    """hidden [tokens, h]: the mean token norm; the std over tokens of `heads` random normal(0, std) heads' values
    (averaged over the heads: what varies from token to token, a head's constant offset excluded); and the rms of
    those values (offset included; its expectation is std * rms token norm)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = hidden.double()
    weights = torch.randn(hidden.shape[-1], heads, generator=gen, dtype=torch.float64) * std
    values = hidden @ weights  # [tokens, heads]
    norms = hidden.norm(dim=-1)
    return {"tokens": int(hidden.shape[0]), "hidden_norm_mean": float(norms.mean()),
            "value_std": float(values.std(dim=0).mean()), "value_rms": float(values.pow(2).mean().sqrt()),
            "value_rms_expected": float(std * norms.pow(2).mean().sqrt())}


def final_hidden_states(model_dir: str, prompts: list[list[dict]]) -> torch.Tensor:
    """The model's last (post-norm) hidden states over every prompt token, in the chat template the trainer uses."""
    from transformers import AutoModelForCausalLM

    from megatron_ppo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for messages in prompts:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
            out.append(model.model(input_ids=ids).last_hidden_state[0])
    return torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    import pyarrow.parquet as pq

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--data", default="outputs/gsm8k/data/test.parquet")
    p.add_argument("--n", type=int, default=16, help="prompts (the first n rows)")
    args = p.parse_args(argv)
    rows = pq.read_table(args.data, columns=["prompt", "reward_model"]).slice(0, args.n).to_pylist()
    stats = value_spread(final_hidden_states(args.model, [r["prompt"] for r in rows]))
    stats.update(model=args.model, data=args.data, prompts=len(rows), init_std=INIT_STD)
    json.dump(stats, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
