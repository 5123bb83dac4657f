"""The LM-head loss's elementwise pass per chunk: what each way of compiling it costs on a GPU.

Why: a torch.profiler run of Qwen3-30B-A3B's shape (vocabulary 151,936, chunks of 832 tokens)
showed the fused kernel of `roundpipe.model.loss.softmax_cross_entropy_grad` (logsumexp over the
vocabulary, then softmax minus the one-hot, written in the logits' dtype) at ~3.9 ms a chunk: about
0.5 GB read and written, so ~130 GB/s where the GPU's memory moves ~3 TB/s. This times the pass
alone at the chunk shapes roundpipe uses, as the layers compile it (``dynamic=True``: chunk lengths
vary), compiled for the exact shape, and eagerly; each line gives milliseconds, the GB/s of one
read of the logits and one write of their gradient, and whether its numbers equal eager's.

    python bench/loss_kernel_gpu.py                     # on the GPU machine, well under a minute
    python bench/loss_kernel_gpu.py --device cpu --rows 64 --vocab 4096 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_kernels import timed_ms

from roundpipe.model.loss import softmax_cross_entropy_grad
from roundpipe.model.transformers_presets import auto_chunk_tokens

VOCABS = {"qwen3": 151936, "gpt_oss": 201088, "llama3": 128256}


def measure(rows: int, vocab: int, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=g).mul_(3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    weights = torch.full((rows,), 1.0 / rows, device=device)
    variants: dict[str, Callable[..., Any]] = {
        "eager": softmax_cross_entropy_grad,
        "compiled_dynamic": torch.compile(softmax_cross_entropy_grad, dynamic=True),
        "compiled_static": torch.compile(softmax_cross_entropy_grad, dynamic=False),
    }
    want_loss, want_grad = softmax_cross_entropy_grad(logits, labels, weights)
    lines = []
    for name, fn in variants.items():
        torch._dynamo.reset()
        loss, grad = fn(logits, labels, weights)
        ms = timed_ms(lambda f=fn: f(logits, labels, weights), device, repeats)  # type: ignore[misc]
        moved = logits.numel() * logits.element_size() * 2  # the logits read, their gradient written
        lines.append(
            {
                "variant": name,
                "rows": rows,
                "vocab": vocab,
                "ms": round(ms, 3),
                "gbps": round(moved / ms / 1e6, 1),
                "loss_diff": float((loss - want_loss).abs()),
                "grad_max_diff": float((grad.float() - want_grad.float()).abs().max()),
            }
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--rows", type=int, default=0, help="tokens per chunk (default: roundpipe's for the vocabulary)"
    )
    p.add_argument("--vocab", type=int, default=0, help="one vocabulary (default: Qwen3's and GPT-OSS's)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    vocabs = [args.vocab] if args.vocab else [VOCABS["qwen3"], VOCABS["gpt_oss"]]
    for vocab in vocabs:
        rows = args.rows or auto_chunk_tokens(vocab, fused=True)
        for line in measure(rows, vocab, device, args.repeats):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
