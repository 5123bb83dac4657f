"""The host optimizer lane on its own: AdamW step, P-copy and G-copy for a model's worth of units.

Why: in asynchronous mode the optimizer lane must finish a step within one iteration of GPU
work or it becomes the bottleneck, and in synchronous mode it is on the critical path. This
measures the lane's three operations per unit on the host (and what the async remedy
``weight_prediction`` adds to them), at the thread counts the CUDA
backend would use, for a Qwen3-1.7B-sized model (28 units of 50M parameters plus the 311M
embedding) by default. One JSON line per thread count.

    python bench/host_optimizer.py [--units 28] [--unit-params 50.3e6] [--embed-params 311e6]
        [--prediction 2,-1] [--kernel fused|foreach|loop]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from roundpipe.config import prediction_factors
from roundpipe.optim.prediction import WeightPredictor

# torch's AdamW implementations on CPU tensors: roundpipe's host_adamw uses "fused"; "loop" is
# what torch.optim.AdamW(params) picks for CPU tensors when nothing is said.
KERNELS: dict[str, dict[str, Any]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "loop": {"foreach": False},
}


def _units(args: argparse.Namespace) -> list[list[torch.Tensor]]:
    sizes = [int(args.embed_params)] + [int(args.unit_params)] * args.units
    return [[torch.randn(size, dtype=torch.float32)] for size in sizes]


def run(args: argparse.Namespace, threads: int) -> dict[str, object]:
    torch.set_num_threads(threads)
    masters = _units(args)
    pin = torch.cuda.is_available()
    compute = [
        [p.to(torch.bfloat16).pin_memory() if pin else p.to(torch.bfloat16) for p in u] for u in masters
    ]
    landing = [[torch.randn_like(p).pin_memory() if pin else torch.randn_like(p) for p in u] for u in masters]
    opts = [torch.optim.AdamW(u, lr=1e-4, **KERNELS[args.kernel]) for u in masters]
    step_s, p_copy_s, g_copy_s, remember_s, predict_s = [], [], [], [], []
    # the async remedy's extra work (roundpipe/optim/prediction.py)
    predictor = WeightPredictor(prediction_factors(args.prediction))
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        for unit in masters:
            for master in unit:
                predictor.remember(id(master), master)
        remember_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for unit, grads in zip(masters, landing, strict=True):
            for master, grad in zip(unit, grads, strict=True):
                master.grad = grad  # adopted, as the G-copy does
        g_copy_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for opt in opts:
            opt.step()
        step_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        with torch.no_grad():
            for unit, copies in zip(masters, compute, strict=True):
                for master, copy in zip(unit, copies, strict=True):
                    copy.copy_(master)
        p_copy_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for unit, copies in zip(masters, compute, strict=True):
            for master, copy in zip(unit, copies, strict=True):
                predictor.predict_into(id(master), copy, master)
        predict_s.append(time.perf_counter() - started)
    params = sum(p.numel() for u in masters for p in u)
    return {
        "bench": "host_optimizer",
        "params_m": round(params / 1e6, 1),
        "threads": threads,
        "kernel": args.kernel,
        "cores": os.cpu_count(),
        "step_ms": round(statistics.median(step_s[1:]) * 1e3, 1),
        "p_copy_ms": round(statistics.median(p_copy_s[1:]) * 1e3, 1),
        "g_copy_ms": round(statistics.median(g_copy_s[1:]) * 1e3, 3),
        # weight_prediction: the step first keeps the weights it starts from, and the P-copy
        # extrapolates instead of copying; the extra host work is remember + (predict - p_copy).
        "remember_ms": round(statistics.median(remember_s[1:]) * 1e3, 1),
        "predict_p_copy_ms": round(statistics.median(predict_s[1:]) * 1e3, 1),
        "prediction": args.prediction,
        "pinned": pin,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=28)
    parser.add_argument("--unit-params", type=float, default=50.3e6)
    parser.add_argument("--embed-params", type=float, default=311e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--kernel",
        choices=sorted(KERNELS),
        default="fused",
        help="AdamW implementation (default: fused, as roundpipe)",
    )
    parser.add_argument(
        "--prediction", default="2,-1", help="weight_prediction factors (roundpipe train's default: 2,-1)"
    )
    parser.add_argument(
        "--threads", type=str, default="", help="comma list; default: all cores and all but 3"
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({cores, max(1, cores - 3)})
    for threads in counts:
        print(json.dumps(run(args, threads)), flush=True)


if __name__ == "__main__":
    main()
