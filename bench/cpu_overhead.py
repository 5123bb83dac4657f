"""Framework overhead on one CPU worker: roundpipe `cpu:1` against the plain PyTorch loop.

Same model, same batch, same optimizer, in the same process, alternating so drift in the
machine's speed hits both. With one device the planner puts every layer in the fused stage
(nothing is recomputed), so the difference is roundpipe's own cost: the engine, the transient
parameter copy, the host gradient buffers and the optimizer lane. Prints one JSON line per
configuration; the target is < 10 % when a layer takes >= 5 ms.

    python bench/cpu_overhead.py [--layers 8] [--width 1024] [--batch 512] [--steps 6]

(--batch is the rows of one microbatch; a batch holds that times the microbatch count.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import roundpipe


def build(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, 16))


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def time_plain(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, microbatches: int, steps: int
) -> list[float]:
    opt = sgd(list(model.parameters()))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            (nn.functional.mse_loss(model(xm), ym) / microbatches).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def time_pipe(pipe: roundpipe.RoundPipe, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pipe.forward_backward(x, y, nn.functional.mse_loss)
        pipe.step()
        pipe.synchronize()
        times.append(time.perf_counter() - start)
    return times


def layer_ms(width: int, batch: int) -> float:
    layer = nn.Linear(width, width)
    x = torch.randn(batch, width)
    with torch.no_grad():
        layer(x)
        start = time.perf_counter()
        for _ in range(5):
            layer(x)
    return (time.perf_counter() - start) / 5 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512, help="rows per microbatch")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    for microbatches in (1, 4):
        # Every configuration keeps a microbatch at --batch rows, so a layer takes as long in each.
        x = torch.randn(args.batch * microbatches, args.width)
        y = torch.randn(args.batch * microbatches, 16)
        for async_optimizer in (False, True):
            plain_model = build(args.layers, args.width)
            pipe_model = build(args.layers, args.width)
            config = roundpipe.RunConfig(
                devices="cpu:1", num_microbatches=microbatches, async_optimizer=async_optimizer
            )
            with roundpipe.RoundPipe(pipe_model, optimizer=sgd, config=config) as pipe:
                time_pipe(pipe, x, y, 2)  # warm-up (and the re-plan from measured times)
                time_plain(plain_model, x, y, microbatches, 2)
                plain: list[float] = []
                ours: list[float] = []
                for _ in range(args.steps):  # alternate so machine drift hits both
                    plain += time_plain(plain_model, x, y, microbatches, 1)
                    ours += time_pipe(pipe, x, y, 1)
            plain_s = statistics.median(plain)
            ours_s = statistics.median(ours)
            print(
                json.dumps(
                    {
                        "bench": "cpu_overhead",
                        "microbatches": microbatches,
                        "async_optimizer": async_optimizer,
                        "layers": args.layers,
                        "layer_fwd_ms": round(layer_ms(args.width, args.batch), 2),
                        "plain_s": round(plain_s, 4),
                        "roundpipe_s": round(ours_s, 4),
                        "overhead": round(ours_s / plain_s - 1, 4),
                        "target": 0.10,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
