"""Iteration time of a link-bound plan with its parameters uploaded 1, 2 or 3 stages ahead.

Workload D2 (GPT-OSS-20B, 4 x 4096 tokens, one device) as an H100 measured it: per layer and
microbatch 2.8 ms forward and 4.6 ms backward (compute 714 ms and recompute 271 ms a step over 24
decoder layers and 4 microbatches), 1.65 GB uploaded a decoder layer, 1.16 GB for the embedding
and for the LM head; its plan, twelve forward stages of two layers, a fused stage of the last two
and twelve backward stages; the link at ``--link-gbps``. Runs the plan on the fake engine
(async, one round of 4 microbatches, six chained iterations) at each depth of
`ScheduleOptions.prefetch_stages` and prints one JSON line each: milliseconds per iteration and
the uploads' own time. Run: ``python bench/prefetch_link.py`` (CPU, a few seconds).
"""

from __future__ import annotations

import argparse
import json

from roundpipe.plan import LayerCosts, Plan
from roundpipe.planning.simulate import simulate

DECODER_LAYERS, MICROBATCHES, ITERATIONS = 24, 4, 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=55.0)
    parser.add_argument("--fwd-ms", type=float, default=2.8, help="a decoder layer's forward, per microbatch")
    parser.add_argument("--bwd-ms", type=float, default=4.6, help="its backward without recompute")
    args = parser.parse_args()
    upload = (1_160_000_000, *[1_650_000_000] * DECODER_LAYERS, 1_160_000_000)
    layers = len(upload)
    costs = LayerCosts(
        (1.0, *[args.fwd_ms] * DECODER_LAYERS, 6.0),
        (1.0, *[args.bwd_ms] * DECODER_LAYERS, 8.0),
        upload,
        tuple(str(i) for i in range(layers)),
    )
    stages = tuple(range(i, i + 2) for i in range(0, layers - 2, 2))
    plan = Plan(stages, range(layers - 2, layers), stages[::-1], 1.0, 1, MICROBATCHES)
    uploads_ms = 2 * sum(upload) / (args.link_gbps * 1e6)  # forward and backward slots, fused once
    uploads_ms -= sum(upload[layers - 2 :]) / (args.link_gbps * 1e6)
    for prefetch in (1, 2, 3):
        result = simulate(
            plan,
            costs,
            1,
            MICROBATCHES,
            iterations=ITERATIONS,
            link_gbps=args.link_gbps,
            param_bytes=upload,
            round_size=MICROBATCHES,
            act_bytes=4096 * 2880 * 2,
            prefetch_stages=prefetch,
        )
        result.trace.check_rules()
        line = {
            "workload": "D2",
            "prefetch_stages": prefetch,
            "iteration_ms": round(result.makespan_ms / ITERATIONS, 1),
            "uploads_ms": round(uploads_ms, 1),
        }
        print(json.dumps(line))


if __name__ == "__main__":
    main()
