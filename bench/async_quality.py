"""Does the asynchronous optimizer learn as well as the synchronous one? Loss curves per remedy.

Why: staleness 1 hides the CPU optimizer behind the next iteration but costs learning (issue 13:
`roundpipe train` ended at 2.473 async against 1.929 sync). This runs `roundpipe train`'s main job
(qwen3-tiny on the shipped corpus, AdamW with warmup + cosine, 200 steps) in each optimizer mode
at the default learning rate and at 2x and 4x it, and a LoRA run (``--lora-r 8``), and prints one
JSON line per run (final loss, loss at a few steps, gap to sync, seconds). ``--png`` draws the
curves (needs matplotlib).

Two engines give the same numbers: ``pipe`` runs `roundpipe.train.train` itself (the pipe on CPU
workers); ``reference`` runs the plain PyTorch loop that tests/test_async_remedies.py proves the
pipe equal to (gradient of iteration t at the weights the mode prescribes, applied to the newest
weights), one thread per run, so ``--jobs`` runs go side by side on a small machine.

    python bench/async_quality.py --engine reference --jobs 2 --png docs/async_quality.png
    python bench/async_quality.py --engine pipe --only main-1x
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# Modes: name -> (async_optimizer, async_warmup_steps, weight_prediction, lr ramp (steps, start)).
MODES: dict[str, tuple[bool, int, float, tuple[int, float]]] = {
    "sync": (False, 0, 0.0, (0, 0.4)),
    "async": (True, 0, 0.0, (0, 0.4)),
    "async+warmup20": (True, 20, 0.0, (0, 0.4)),
    "async+predict2": (True, 0, 2.0, (0, 0.4)),
    "async+warmup20+predict2": (True, 20, 2.0, (0, 0.4)),
    "async+warmup20+ramp60": (True, 20, 0.0, (60, 0.4)),
    "async+warmup20+predict2+ramp60": (True, 20, 2.0, (60, 0.4)),
    "async+warmup20+predict2+ramp120": (True, 20, 2.0, (120, 0.4)),  # the `roundpipe train` default
}
COMPARED = ("sync", "async", "async+warmup20+predict2", "async+warmup20+predict2+ramp120")
# Jobs: name -> (lr multiplier, lora rank, modes).
JOBS: dict[str, tuple[float, int | None, tuple[str, ...]]] = {
    "main-1x": (1.0, None, tuple(MODES)),
    "main-2x": (2.0, None, COMPARED),
    "main-4x": (4.0, None, COMPARED),
    "lora-r8": (1.0, 8, COMPARED),
}
MARKS = (10, 20, 40, 60, 100, 150, 199)


def train_config(job: str, mode: str, steps: int) -> Any:
    from roundpipe.train.config import TrainConfig

    lr_mult, lora_r, _ = JOBS[job]
    async_optimizer, warmup, prediction, (ramp_steps, ramp_start) = MODES[mode]
    base = TrainConfig().lr
    return TrainConfig(
        steps=steps,
        lr=base * lr_mult,
        lora_r=lora_r,
        async_optimizer=async_optimizer,
        async_warmup_steps=warmup,
        weight_prediction=prediction,
        async_lr_ramp_steps=ramp_steps,
        async_lr_ramp_start=ramp_start,
    )


def reference_losses(config: Any) -> list[float]:
    """The plain loop: iteration t < warmup reads W_t; later ones W_{t-1}, extrapolated by
    ``weight_prediction`` times the update that made it once that update was asynchronous; the
    async steps of the lr ramp run at its factor times the scheduled lr."""
    import torch

    from roundpipe.optim.lr_ramp import ramp_factor
    from roundpipe.train.data import prepare_data
    from roundpipe.train.loop import lr_factor
    from roundpipe.train.model import build_model, build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer(config)
    batches = prepare_data(config, tokenizer).batches(0)  # the batches `roundpipe train` draws
    model = build_model(config, tokenizer)
    shadow = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    reads = [p for p in shadow.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    warmup = config.async_warmup_steps if config.async_optimizer else 0
    ramp = config.async_lr_ramp_steps if config.async_optimizer else 0
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(config, s) * ramp_factor(s, warmup, ramp, config.async_lr_ramp_start)
    )
    history = [[p.detach().clone() for p in params]]  # the last three versions are enough
    losses = []
    for t in range(config.steps):
        with torch.no_grad():
            for i, read in enumerate(reads):
                if not config.async_optimizer or t < warmup:
                    read.copy_(params[i])
                elif t < 2 or t - 2 < warmup - 1 or not config.weight_prediction:
                    read.copy_(history[-2][i] if t >= 1 else history[-1][i])
                else:
                    read.copy_(torch.lerp(history[-3][i], history[-2][i], 1.0 + config.weight_prediction))
        shadow.zero_grad(set_to_none=True)
        loss = shadow(**next(batches)).loss
        loss.backward()
        for p, read in zip(params, reads, strict=True):
            p.grad = read.grad.clone()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        history = [*history[-2:], [p.detach().clone() for p in params]]
        losses.append(loss.item())
    return losses


def pipe_losses(config: Any) -> list[float]:
    from roundpipe.train.loop import train

    with tempfile.TemporaryDirectory() as out:
        result = train(config.model_copy(update={"out": out, "name": "run"}))
    return list(result.losses)


def run_one(engine: str, job: str, mode: str, steps: int) -> dict[str, Any]:
    config = train_config(job, mode, steps)
    started = time.perf_counter()
    losses = reference_losses(config) if engine == "reference" else pipe_losses(config)
    return {
        "bench": "async_quality",
        "engine": engine,
        "job": job,
        "mode": mode,
        "lr": config.lr,
        "final": round(losses[-1], 4),
        "at": {s: round(losses[s], 3) for s in MARKS if s < len(losses)},
        "seconds": round(time.perf_counter() - started, 1),
        "losses": [round(x, 4) for x in losses],
    }


def smoothed(losses: list[float], window: int = 10) -> list[float]:
    """Trailing mean: single-batch losses are noisy; the final figures stay unsmoothed."""
    return [sum(losses[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(losses))]


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = list(dict.fromkeys(r["job"] for r in results))
    fig, axes = plt.subplots(1, len(jobs), figsize=(5 * len(jobs), 4), squeeze=False)
    for ax, job in zip(axes[0], jobs, strict=True):
        runs = [r for r in results if r["job"] == job]
        for r in runs:
            color = f"C{list(MODES).index(r['mode'])}"  # one colour per mode in every panel
            ax.plot(
                smoothed(r["losses"]), label=f"{r['mode']} ({r['final']:.3f})", color=color, linewidth=1.2
            )
        ax.set_title(f"{job} (peak lr {runs[0]['lr']:.2g})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (10-step mean)")
        low = min(min(smoothed(r["losses"])) for r in runs) - 0.1
        ax.set_ylim(low, low + 2.0)  # the first steps (loss 5.5) would flatten the rest
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of docs/performance.md: final loss and gap to sync per job and mode."""
    lines = [
        "| job | mode | final loss | vs sync | mean of last 20 | vs sync |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    order = {job: i for i, job in enumerate(JOBS)}
    modes = {mode: i for i, mode in enumerate(MODES)}
    for r in sorted(results, key=lambda r: (order.get(r["job"], 99), modes.get(r["mode"], 99))):
        gap = f"{r['vs_sync']:+.1%}" if "vs_sync" in r and r["mode"] != "sync" else ""
        tail_gap = f"{r['tail_vs_sync']:+.1%}" if "tail_vs_sync" in r and r["mode"] != "sync" else ""
        lines.append(f"| {r['job']} | {r['mode']} | {r['final']:.3f} | {gap} | {tail(r):.3f} | {tail_gap} |")
    return "\n".join(lines)


def tail(result: dict[str, Any], steps: int = 20) -> float:
    """Mean loss of the last ``steps`` steps: the final loss is one batch, and a trajectory that
    differs by one step early on ends a few hundredths away by chance alone."""
    last = result["losses"][-steps:]
    return sum(last) / len(last)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("pipe", "reference"), default="pipe")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (reference engine)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", nargs="*", default=None, help="job names, or job:mode")
    parser.add_argument("--png", default=None, help="draw the curves into this PNG")
    parser.add_argument("--json", default=None, help="also write every result (with curves) here")
    parser.add_argument("--load", nargs="*", default=(), help="results of earlier --json runs to include")
    args = parser.parse_args(argv)
    runs = [(job, mode) for job, (_, _, modes) in JOBS.items() for mode in modes]
    if args.only is not None:
        runs = [(j, m) for j, m in runs if j in args.only or f"{j}:{m}" in args.only]
    results: list[dict[str, Any]] = [r for path in args.load for r in json.loads(Path(path).read_text())]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_one, args.engine, job, mode, args.steps) for job, mode in runs]
        for future in futures:
            results.append(future.result())
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    for result in results:
        sync = next((r for r in results if r["job"] == result["job"] and r["mode"] == "sync"), None)
        if sync is not None:
            result["vs_sync"] = round(result["final"] / sync["final"] - 1, 4)
            result["tail_vs_sync"] = round(tail(result) / tail(sync) - 1, 4)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results) + "\n")
    if args.png:
        plot(results, args.png)
        print(f"curves: {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
