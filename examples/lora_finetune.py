"""LoRA fine-tuning of a Qwen3-style model with roundpipe, on two CPU workers.

The model is the ``qwen3-tiny`` preset (random weights, byte vocabulary) wrapped by peft with LoRA
adapters on the attention projections. roundpipe trains only the adapters: the base weights are
frozen, so they are uploaded to the workers but never receive gradients or optimizer state.

The script shows the loss falling, checks that no base weight moved, saves the adapters with
``save_pretrained``, loads them back into a fresh copy of the base model with
``PeftModel.from_pretrained`` and checks that both give the same logits.

    python examples/lora_finetune.py --steps 40 --out lora-adapters
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model

import roundpipe
from roundpipe.data.text import CORPUS_PATH, token_batches
from roundpipe.model import build_model

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--out", type=Path, default=None, help="adapter directory (default: a temp dir)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser.parse_args(argv)


def lora_model(rank: int) -> Any:
    """The qwen3-tiny preset with LoRA adapters on q/k/v/o. Same seed, same base weights."""
    base = build_model("qwen3-tiny", seed=0)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGET_MODULES)
    return get_peft_model(base, config)


def base_weights(model: Any) -> dict[str, torch.Tensor]:
    """Copies of every frozen parameter (the base model's weights)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def train(args: argparse.Namespace, model: Any) -> list[float]:
    config = roundpipe.RunConfig(
        devices="cpu:2",
        num_microbatches=args.microbatches,
        async_optimizer=True,
        precision="fp32",
    )
    batches = token_batches(CORPUS_PATH, seq_len=args.seq_len, batch_size=args.batch_size, seed=0)
    losses: list[float] = []
    with roundpipe.RoundPipe(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
        config=config,
    ) as pipe:
        if not args.quiet:
            print(pipe.plan)
        for step in range(args.steps):
            # A transformers model computes its own loss: targets and loss_fn are None.
            loss = pipe.forward_backward(next(batches), None, None)
            pipe.step()
            losses.append(loss)
            if not args.quiet and (step % 5 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss:.4f}")
        pipe.synchronize()  # the peft model's parameters now hold the trained adapters
    return losses


def logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def reload_adapters(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """Save the adapters, load them into a fresh base model and compare the logits."""
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out if args.out is not None else Path(tmp) / "adapters"
        model.save_pretrained(out)
        # A fresh base model (same seed, so the same base weights) with the saved adapters.
        reloaded = PeftModel.from_pretrained(build_model("qwen3-tiny", seed=0), out)
        sample = next(token_batches(CORPUS_PATH, seq_len=args.seq_len, batch_size=2, seed=1))["input_ids"]
        expected, got = logits(model, sample), logits(reloaded, sample)
        # Without adapters the logits differ: the reload really carries the training.
        with reloaded.disable_adapter():
            adapter_effect = float((logits(reloaded, sample) - got).abs().max())
        return {
            "same_logits": torch.allclose(expected, got, rtol=1e-5, atol=1e-5),
            "max_logit_diff": float((expected - got).abs().max()),
            "adapter_effect": adapter_effect,
            "saved_files": sorted(p.name for p in out.iterdir()),
        }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 to compare the first and last losses")
    model = lora_model(args.rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if not args.quiet:
        print(f"trainable parameters: {trainable:,} of {total:,} ({trainable / total:.2%})")
    frozen_before = base_weights(model)
    adapters_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    losses = train(args, model)

    # The first and last few steps, averaged (single batches are noisy).
    window = max(1, min(5, len(losses) // 4))
    first, last = mean(losses[:window]), mean(losses[-window:])
    fell = last < first and all(math.isfinite(x) for x in losses)
    frozen_after = base_weights(model)
    base_unchanged = frozen_before.keys() == frozen_after.keys() and all(
        torch.equal(frozen_before[n], frozen_after[n]) for n in frozen_before
    )
    adapters_moved = any(
        not torch.equal(adapters_before[n], p.detach())
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    reload = reload_adapters(args, model)
    print(
        f"loss {first:.4f} -> {last:.4f} ({'fell' if fell else 'DID NOT FALL'}); "
        f"base weights {'unchanged' if base_unchanged else 'CHANGED'}; "
        f"adapters saved ({', '.join(reload['saved_files'])}) and reloaded: max logit difference "
        f"{reload['max_logit_diff']:.2e} ({'same' if reload['same_logits'] else 'DIFFERENT'}); "
        f"adapters change the logits by up to {reload['adapter_effect']:.3f}"
    )
    return {
        "first_loss": first,
        "last_loss": last,
        "loss_fell": fell,
        "base_unchanged": base_unchanged,
        "adapters_moved": adapters_moved,
        **reload,
        "losses": losses,
    }


if __name__ == "__main__":
    result = main(sys.argv[1:])
    ok = (
        result["loss_fell"]
        and result["base_unchanged"]
        and result["adapters_moved"]
        and result["same_logits"]
    )
    sys.exit(0 if ok else 1)
