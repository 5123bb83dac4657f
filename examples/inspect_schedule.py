"""Plan, simulate, check and replay a roundpipe schedule, then do the same for a real CPU run.

Part 1 needs no hardware and no model: it estimates per-layer costs from a model *shape*
(a Qwen3-1.7B-like decoder by default), lets ``partition`` split the layers into stages, runs the
real scheduling engine on the fake backend under a virtual clock (``simulate``) for a few
iterations with the asynchronous optimizer, prints the bubble ratio and per-device utilisation,
checks the five ordering rules, saves the trace, loads it back, replays it and shows that every
lane runs its tasks in the same order. It also writes Perfetto JSON (open it in ui.perfetto.dev)
and a PNG timeline.

Part 2 trains a small ``nn.Sequential`` for a few steps on two CPU workers and does the same with
``pipe.trace()``: the trace of what really ran is checked against the rules and replayed. A real
run's durations jitter, so its replay keeps the task graph and the durations but may order tasks
that became ready at nearly the same moment differently; the script says where.

    python examples/inspect_schedule.py --out schedule-out
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roundpipe.plan import LayerCosts, Plan, analytic_bubble, partition
from roundpipe.planning.simulate import simulate
from roundpipe.sched import Trace
from roundpipe.sched.export import format_grid


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer, as far as its cost is concerned."""

    layers: int = 28
    hidden: int = 2048
    intermediate: int = 6144
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    tokens: int = 4096  # tokens per microbatch
    tflops: float = 80.0  # sustained bf16 TFLOP/s of one device
    bytes_per_param: int = 2  # bf16 weights on the device


def costs_for_shape(shape: Shape) -> LayerCosts:
    """Rough per-layer costs for one microbatch: forward time from FLOPs, backward twice the
    forward, memory = weights + their gradients + a working set of activations."""
    s = shape
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
    block_params = s.hidden * (2 * q_dim + 2 * kv_dim) + 3 * s.hidden * s.intermediate
    # Matmuls: 2 FLOPs per parameter per token; causal attention: QK^T and AV over half the pairs.
    block_flops = 2 * block_params * s.tokens + 2 * s.tokens * s.tokens * q_dim
    head_params = s.hidden * s.vocab
    head_flops = 2 * head_params * s.tokens
    activations = s.tokens * (4 * s.hidden + 2 * s.intermediate) * s.bytes_per_param

    def ms(flops: float) -> float:
        return flops / (s.tflops * 1e12) * 1e3

    def mem(params: int, act: int) -> int:
        return 2 * params * s.bytes_per_param + act

    fwd = [0.1, *[ms(block_flops)] * s.layers, ms(head_flops)]  # the embedding is a lookup
    memory = [
        mem(head_params, s.tokens * s.hidden * s.bytes_per_param),
        *[mem(block_params, activations)] * s.layers,
        # The LM head keeps chunked logits only (roundpipe's chunked loss), not tokens x vocab.
        mem(head_params, 1024 * s.vocab * 4),
    ]
    names = ["embed", *[f"block.{i}" for i in range(s.layers)], "head"]
    return LayerCosts(tuple(fwd), tuple(2 * f for f in fwd), tuple(memory), tuple(names))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write traces and pictures (default: temp dir)"
    )
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (default 28)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument("--devices", type=int, default=4, help="simulated devices (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per iteration (default 8)")
    parser.add_argument("--iterations", type=int, default=4, help="simulated iterations (default 4)")
    parser.add_argument("--link-gbps", type=float, default=25.0, help="host link GB/s, 0 = free (default 25)")
    parser.add_argument("--mem-gib", type=float, default=24.0, help="device memory in GiB (default 24)")
    parser.add_argument(
        "--real-steps", type=int, default=3, help="steps of the real CPU run, 0 = skip (default 3)"
    )
    parser.add_argument("--no-png", action="store_true", help="skip the PNG pictures")
    return parser.parse_args(argv)


def compare_orders(a: Trace, b: Trace) -> tuple[int, int, str | None]:
    """(lanes with the same start order, lanes in all, the first difference or None)."""
    order_a, order_b = a.order(), b.order()
    lanes = sorted(set(order_a) | set(order_b))
    same, first = 0, None
    for lane in lanes:
        x, y = order_a.get(lane, []), order_b.get(lane, [])
        if x == y:
            same += 1
        elif first is None:
            at = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            by_key = {t.key: t for t in a.records}
            what = by_key[x[at]].describe() if at < len(x) else "nothing"
            first = f"lane {lane}, position {at}: the recorded run started {what} there"
    return same, len(lanes), first


def print_utilisation(report: Any) -> None:
    for device, bubble in sorted(report.per_device.items()):
        busy = report.busy_ms[device]
        print(f"  device {device}: busy {busy:9.1f} ms  utilisation {1 - bubble:6.1%}")


def simulated(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    print("== Part 1: a simulated schedule ==")
    shape = Shape(layers=args.layers, hidden=args.hidden)
    costs = costs_for_shape(shape)
    mem_limit = int(args.mem_gib * 2**30)
    plan: Plan = partition(costs, args.devices, args.microbatches, mem_limit, async_optimizer=True)
    print(plan)
    result = simulate(
        plan,
        costs,
        args.devices,
        args.microbatches,
        iterations=args.iterations,
        async_optimizer=True,
        link_gbps=args.link_gbps or None,
    )
    trace = result.trace
    print(f"{len(trace)} tasks, makespan {result.makespan_ms:.1f} ms for {args.iterations} iterations")
    print(f"bubble ratio {result.bubble_ratio:.2%} (fill and drain included)")
    if result.steady_bubble_ratio is not None:
        print(f"steady-state bubble {result.steady_bubble_ratio:.2%} (the middle iterations)")
    print(
        f"analytic bubble of one synchronous iteration {analytic_bubble(args.devices, args.microbatches, plan.num_slots):.2%}"
    )
    print_utilisation(result.bubble)
    print(format_grid(trace, width=96))

    trace.check_rules()
    print("check_rules(): the five ordering rules hold")
    path = trace.save(out / "simulated.trace.json")
    loaded = Trace.load(path)
    replayed = loaded.replay()
    replayed.check_rules()
    same, lanes, first = compare_orders(loaded, replayed)
    identical = same == lanes and len(replayed) == len(loaded)
    print(
        f"saved {path.name}, loaded {len(loaded)} tasks back, replayed: "
        f"{same} of {lanes} lanes in the same order"
        + (" (identical)" if identical else f"; first difference: {first}")
    )
    files = [trace.to_perfetto(out / "simulated.perfetto.json")]
    if not args.no_png:
        files.append(trace.plot(out / "simulated.png"))
    print("wrote " + ", ".join(str(f) for f in files))
    return {
        "plan": plan,
        "bubble_ratio": result.bubble_ratio,
        "steady_bubble_ratio": result.steady_bubble_ratio,
        "utilisation": result.utilisation,
        "tasks": len(trace),
        "replay_identical": identical,
        "replay_makespan_ms": replayed.makespan_ms(),
        "makespan_ms": result.makespan_ms,
        "files": files,
    }


def real(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch
    from torch import nn

    import roundpipe

    print("\n== Part 2: the trace of a real run on two CPU workers ==")
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)],
        nn.Linear(128, 4),
    )
    x, y = torch.randn(64, 128), torch.randn(64, 4)
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=4, async_optimizer=True)
    losses = []
    with roundpipe.RoundPipe(
        model, optimizer=lambda params: torch.optim.SGD(params, lr=0.05), config=config
    ) as pipe:
        for _ in range(args.real_steps):
            losses.append(pipe.forward_backward(x, y, nn.functional.mse_loss))
            pipe.step()
        pipe.synchronize()
        print(pipe.plan)
        trace = pipe.trace()
    print("losses " + ", ".join(f"{loss:.4f}" for loss in losses))
    print(trace.summary())
    trace.check_rules()
    print("check_rules(): the five ordering rules hold on what really ran")
    path = trace.save(out / "cpu.trace.json")
    loaded = Trace.load(path)
    replayed = loaded.replay()
    replayed.check_rules()
    same, lanes, first = compare_orders(loaded, replayed)
    print(
        f"replayed on the fake backend with the recorded durations: {len(replayed)} tasks, "
        f"makespan {replayed.makespan_ms():.1f} ms (recorded {loaded.makespan_ms():.1f} ms), "
        f"{same} of {lanes} lanes in the same order"
        + ("" if first is None else f"; first difference: {first}")
    )
    files = [trace.to_perfetto(out / "cpu.perfetto.json")]
    if not args.no_png:
        files.append(trace.plot(out / "cpu.png"))
    print("wrote " + ", ".join(str(f) for f in files))
    return {
        "losses": losses,
        "tasks": len(trace),
        "replayed_tasks": len(replayed),
        "lanes_same_order": same,
        "lanes": lanes,
        "files": files,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out if args.out is not None else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        result = {"simulated": simulated(args, out)}
        if args.real_steps > 0:
            result["real"] = real(args, out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
