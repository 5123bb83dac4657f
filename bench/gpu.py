"""One GPU: roundpipe `cuda:0` against the plain PyTorch loop, same model and batch, same run.

The plain loop keeps everything on the GPU (weights, gradients, AdamW state) and steps with
fused AdamW; roundpipe keeps all of it in host memory, uploads each stage's weights, runs the
optimizer on the CPU and (async) one step behind. On a single datacenter GPU with plenty of
memory the plain loop should be faster; the point of the figures is what roundpipe costs in
throughput and what it saves in GPU memory. Prints one JSON line per configuration.

    python bench/gpu.py [--hidden 1024] [--layers 12] [--seq 1024] [--batch 16] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import roundpipe


def build(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def batch(size: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (size, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def plain(args: argparse.Namespace, data: dict[str, torch.Tensor]) -> dict[str, float]:
    model = build(args.hidden, args.layers, args.vocab).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = {k: v.cuda() for k, v in data.items()}
    micro = [{k: v.chunk(args.microbatches)[i] for k, v in data.items()} for i in range(args.microbatches)]
    torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    fwd_bwd: list[float] = []
    for _ in range(args.steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for mb in micro:
            (model(**mb).loss / args.microbatches).backward()
        torch.cuda.synchronize()
        fwd_bwd.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[2:])
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    torch.cuda.empty_cache()
    return {"step_s": step, "peak_gib": peak, "fwd_bwd_ms": statistics.median(fwd_bwd[2:]) * 1e3}


def ours(args: argparse.Namespace, data: dict[str, torch.Tensor], async_optimizer: bool) -> dict[str, float]:
    model = build(args.hidden, args.layers, args.vocab)
    config = roundpipe.RunConfig(
        devices="cuda:0",
        num_microbatches=args.microbatches,
        precision="bf16",
        async_optimizer=async_optimizer,
    )
    torch.cuda.reset_peak_memory_stats()

    def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4, fused=True)  # fused CPU AdamW

    with roundpipe.RoundPipe(model, optimizer=adamw, config=config) as pipe:
        times = []
        for i in range(args.steps + 2):
            if i == 2:  # warm-up done: the breakdown below covers the measured steps only
                pipe.synchronize()
                pipe.trace().clear()
            start = time.perf_counter()
            pipe.forward_backward(data)
            pipe.step()
            if not async_optimizer:
                pipe.synchronize()
            times.append(time.perf_counter() - start)
        pipe.synchronize()
        trace = pipe.trace()
        bubble = trace.bubble_ratio().overall
        slots = pipe.plan.num_slots
        iterations = len({t.iteration for t in trace if t.iteration >= 0})
        busy: dict[str, float] = {}
        for task in trace:
            busy[task.kind] = busy.get(task.kind, 0.0) + task.duration
    return {
        "step_s": statistics.median(times[2:]),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "bubble": bubble,
        "slots": slots,
        "busy_ms_per_step": {k: round(v / max(iterations, 1), 1) for k, v in sorted(busy.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    data = batch(args.batch, args.seq, args.vocab)
    tokens = args.batch * args.seq
    base = plain(args, data)
    params = sum(p.numel() for p in build(args.hidden, args.layers, args.vocab).parameters())
    for async_optimizer in (False, True):
        result = ours(args, data, async_optimizer)
        print(
            json.dumps(
                {
                    "bench": "gpu_one_device",
                    "device": torch.cuda.get_device_name(0),
                    "params_m": round(params / 1e6, 1),
                    "tokens_per_step": tokens,
                    "async_optimizer": async_optimizer,
                    "plain_tokens_per_s": round(tokens / base["step_s"]),
                    "roundpipe_tokens_per_s": round(tokens / result["step_s"]),
                    "throughput_ratio": round(base["step_s"] / result["step_s"], 3),
                    "plain_peak_gib": round(base["peak_gib"], 2),
                    "plain_fwd_bwd_ms_per_step": round(base["fwd_bwd_ms"], 1),
                    "roundpipe_peak_gib": round(result["peak_gib"], 2),
                    "roundpipe_bubble": round(result["bubble"], 4),
                    "slots": result["slots"],
                    "busy_ms_per_step": result["busy_ms_per_step"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
