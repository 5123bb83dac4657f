"""Tokens per second a link-bound mixture of experts can reach: the fake engine on a cost model.

Workload D: Qwen3-30B-A3B (48 decoder layers, hidden 2048, 128 experts of width 768, 8 per token,
32 heads and 4 KV heads of 128, vocabulary 151936), LoRA on q/k/v/o (experts frozen, bf16 on the
host), one device, microbatches of 4096 tokens, a 24 GiB budget. Layer times come from a FLOP
model (``--expert-tflops``, ``--dense-tflops``: the rates the grouped and dense matrix products
reach), weights from the shapes; the link is ``--link-gbps``. For each number of microbatches it
plans twice, on compute times alone and on link-aware times (`roundpipe.plan.link.link_costs`),
runs both plans on the fake engine with the link on (sync: one iteration, fill and drain
included; ``--mode async``: the mean of four chained iterations), and prints one JSON line per plan: tokens/s,
the plan, and its `LinkReport`. Run: ``python bench/moe_link.py`` (CPU, a few seconds).
"""

from __future__ import annotations

import argparse
import json

from roundpipe.plan import LayerCosts, choose_plan, round_sizes
from roundpipe.plan.link import link_costs, link_report
from roundpipe.planning.simulate import simulate

GIB = 1 << 30


def d_costs(args: argparse.Namespace) -> tuple[LayerCosts, list[int]]:
    """Per-layer times (ms per microbatch), plan bytes and uploaded bytes of workload D."""
    h, e, inter, k, tokens = 2048, 128, 768, 8, args.tokens
    heads, kv, dim, vocab, layers = 32, 4, 128, 151936, 48
    attn_params = h * heads * dim * 2 + 2 * h * kv * dim
    expert_params = e * 3 * h * inter
    block_bytes = 2 * (attn_params + expert_params + e * h + 2 * h)
    expert_flops = tokens * k * 3 * h * inter * 2
    dense_flops = tokens * attn_params * 2 + 2 * 2 * tokens * tokens // 2 * heads * dim
    # Sort, gathers and the weighted sum: about six passes over the routed rows, memory-bound.
    glue_ms = 6 * tokens * k * h * 2 / (args.hbm_gbps * 1e6)
    block_fwd = expert_flops / (args.expert_tflops * 1e9) + dense_flops / (args.dense_tflops * 1e9) + glue_ms
    # Backward without recompute: frozen experts need input gradients only (1x), attention 2x.
    block_bwd = (
        expert_flops / (args.expert_tflops * 1e9) + 2 * dense_flops / (args.dense_tflops * 1e9) + glue_ms
    )
    # Saved activations of a block for one microbatch: routed rows, both projections, attention.
    saved = 2 * tokens * (k * (2 * h + 3 * inter) + 8 * h)
    table = vocab * h * 2
    head_flops = tokens * vocab * h * 2
    fwd = [0.05] + [block_fwd] * layers + [head_flops / (args.dense_tflops * 1e9)]
    bwd = [0.05] + [block_bwd] * layers + [2 * head_flops / (args.dense_tflops * 1e9)]
    uploads = [table] + [block_bytes] * layers + [table + 2 * h]
    mem = [table] + [block_bytes + saved] * layers + [table + 4 * tokens * 8192 * 2]
    names = ["embed", *(f"block.{i}" for i in range(layers)), "head"]
    return LayerCosts(tuple(fwd), tuple(bwd), tuple(mem), tuple(names)), uploads


def run(args: argparse.Namespace, microbatches: int, link_aware: bool) -> dict[str, object]:
    costs, uploads = d_costs(args)
    rounds = round_sizes(microbatches, 1, microbatches)  # CUDA: one round an iteration
    planned = link_costs(costs, uploads, args.link_gbps, min(rounds)) if link_aware else costs
    limit = int(args.budget_gib * GIB * 7 / 8)
    asynchronous = args.mode == "async"
    plan = choose_plan(planned, 1, microbatches, limit, round_size=microbatches, async_optimizer=asynchronous)
    iterations = 4 if asynchronous else 1
    result = simulate(
        plan,
        costs,
        1,
        microbatches,
        iterations=iterations,
        async_optimizer=asynchronous,
        link_gbps=args.link_gbps,
        param_bytes=uploads,
        round_size=microbatches,
    )
    iteration_ms = result.makespan_ms / iterations
    report = link_report(plan, costs, uploads, args.link_gbps, rounds)
    return {
        "workload": "D",
        "mode": args.mode,
        "microbatches": microbatches,
        "tokens_per_microbatch": args.tokens,
        "planned_on": "link-aware" if link_aware else "compute",
        "tokens_per_s": microbatches * args.tokens / (iteration_ms / 1e3),
        "iteration_ms": iteration_ms,
        "slots": plan.num_slots,
        "fused_layers": len(plan.fused),
        "link": report.to_dict(),
        "summary": report.describe(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=55.0)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--expert-tflops", type=float, default=400.0)
    parser.add_argument("--dense-tflops", type=float, default=500.0)
    parser.add_argument("--hbm-gbps", type=float, default=4000.0)
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    parser.add_argument(
        "--mode", choices=["sync", "async"], default="sync", help="async: mean of 4 iterations"
    )
    args = parser.parse_args()
    for m in args.microbatches:
        for aware in (False, True):
            print(json.dumps(run(args, m, aware)))


if __name__ == "__main__":
    main()
