"""Does the asynchronous optimizer learn as well as the synchronous one? Loss curves per remedy.

Why: staleness 1 hides the CPU optimizer behind the next iteration but costs learning (plain
staleness 1 ends about 10% above sync on the main job, over 11 seeds: docs/performance.md). This runs `roundpipe train`'s main job
(qwen3-tiny on the shipped corpus, AdamW with warmup + cosine, 200 steps) in each optimizer mode
at the default learning rate and at 2x and 4x it, and a LoRA run (``--lora-r 8``), and prints one
JSON line per run (final loss, loss at a few steps, gap to sync, seconds). ``--png`` draws the
curves (needs matplotlib).

Two engines give the same numbers: ``pipe`` runs `roundpipe.train.train` itself (the pipe on CPU
workers); ``reference`` runs the plain PyTorch loop that tests/test_async_remedies.py proves the
pipe equal to (gradient of iteration t at the weights the mode prescribes, applied to the newest
weights), one thread per run, so ``--jobs`` runs go side by side on a small machine.

One seed cannot rank remedies a point apart (the gap to sync moves by 2-3 points between seeds):
``--seeds`` runs each mode on several, pairs every run with its seed's sync run and prints the
mean gap, its standard error and the worst seed; ``--device cuda`` runs the reference loop on a
GPU (the CPU's figures to 3-4 decimals), where 16 runs side by side take a few minutes.
``--modes`` takes any mode by name (`Mode.parse`), including experiments only the reference
loop runs.

    python bench/async_quality.py --engine reference --jobs 2 --png docs/async_quality.png
    python bench/async_quality.py --engine pipe --only main-1x
    python bench/async_quality.py --engine reference --device cuda --jobs 16 --seeds 0 1 2 3 4 5 6 7 \
        --only main-2x --modes "async+warmup20+predict2,-1+ramp120" --json 2x.json
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Mode:
    """One optimizer mode, parsed from its name: ``sync`` or ``async``, then ``+``-joined
    remedies: ``warmupN`` (N synchronous steps first), ``predictK`` or ``predictK1,K2`` (weight
    prediction, factors newest update first), ``rampR`` or ``rampR@S`` (the lr ramp over R async
    steps from S, default 0.4), ``beta1B`` (Adam's beta1 is B on the asynchronous steps),
    ``clipC`` (clip the global gradient norm to C), ``freshN`` (`RunConfig.fresh_layers`: the
    deepest N of the pipe's layers, embedding and head included, read W_t; a head tied to the
    embedding stays stale), ``freshatI,J`` (`RunConfig.fresh_at`: the layers at those indices read
    W_t; 1 is the main job's first block), and, in the plain loop only, ``slowatI,J@F`` (those
    layers' units step at F times the lr on the asynchronous steps, default 0.5). ``predictK``
    on ``sync`` is a control: the gradient of step t taken at ``W_t + K (W_t - W_{t-1})``, a
    look-ahead no `roundpipe train` mode runs."""

    async_optimizer: bool
    warmup: int = 0
    prediction: tuple[float, ...] = ()  # factors of the last updates, newest first
    ramp_steps: int = 0
    ramp_start: float = 0.4
    beta1: float | None = None
    clip: float | None = None
    fresh: int = 0  # RunConfig.fresh_layers: the deepest layers' own weights read W_t
    fresh_at: tuple[int, ...] = ()  # RunConfig.fresh_at: these layers read W_t (``freshatI,J``)
    slow_at: tuple[int, ...] = ()  # reference only: these layers' units step at ``slow`` x the lr
    slow: float = 1.0  # (``slowatI,J@F``), on the asynchronous steps

    @classmethod
    def parse(cls, name: str) -> Mode:
        head, *remedies = name.split("+")
        if head not in ("sync", "async"):
            raise ValueError(f"mode {name!r}: starts with 'sync' or 'async', not {head!r}")
        fields: dict[str, Any] = {"async_optimizer": head == "async"}
        for remedy in remedies:
            match = re.fullmatch(
                r"(warmup|predict|ramp|beta1|clip|freshat|fresh|slowat)([0-9.]+(?:,-?[0-9.]+)*)(?:@([0-9.]+))?",
                remedy,
            )
            if match is None:
                raise ValueError(
                    f"mode {name!r}: unknown remedy {remedy!r} (warmupN, predictK, rampR[@S], beta1B, clipC, "
                    "freshN, freshatI[,J], slowatI[,J][@F])"
                )
            kind, value, start = match.groups()
            if kind == "warmup":
                fields["warmup"] = int(value)
            elif kind == "predict":
                fields["prediction"] = tuple(float(k) for k in value.split(","))
            elif kind == "ramp":
                fields["ramp_steps"] = int(value)
                if start is not None:
                    fields["ramp_start"] = float(start)
            elif kind == "beta1":
                fields["beta1"] = float(value)
            elif kind == "fresh":
                fields["fresh"] = int(value)
            elif kind == "freshat":
                fields["fresh_at"] = tuple(int(i) for i in value.split(","))
            elif kind == "slowat":
                fields["slow_at"] = tuple(int(i) for i in value.split(","))
                fields["slow"] = float(start) if start is not None else 0.5
            else:
                fields["clip"] = float(value)
        return cls(**fields)

    @property
    def pipe_supported(self) -> bool:
        """Whether `roundpipe train` runs this mode (the rest are reference-only experiments)."""
        return (
            self.beta1 is None
            and not self.slow_at
            and (self.async_optimizer or not (self.prediction or self.fresh or self.fresh_at))
        )


# The `roundpipe train` default on the main job, whose plan is one fused stage, so that
# TrainConfig.fresh_at_if_fused (the first block) applies; the default before it, and on split plans:
DEFAULT_MODE = "async+warmup20+predict2,-1+ramp120+freshat1"
STALE_DEFAULT_MODE = "async+warmup20+predict2,-1+ramp120"
MODES: tuple[str, ...] = (
    "sync",
    "async",
    "async+warmup20",
    "async+predict2",
    "async+warmup20+predict2",
    "async+warmup20+ramp60",
    "async+warmup20+predict2+ramp60",
    "async+warmup20+predict2+ramp120",
    STALE_DEFAULT_MODE,
    DEFAULT_MODE,
)
COMPARED = (
    "sync",
    "async",
    "async+warmup20+predict2",
    "async+warmup20+predict2+ramp120",
    STALE_DEFAULT_MODE,
    DEFAULT_MODE,
)
# Jobs: name -> (lr multiplier, lora rank, modes).
JOBS: dict[str, tuple[float, int | None, tuple[str, ...]]] = {
    "main-1x": (1.0, None, MODES),
    "main-2x": (2.0, None, COMPARED),
    "main-4x": (4.0, None, COMPARED),
    "lora-r8": (1.0, 8, COMPARED),
}
MARKS = (10, 20, 40, 60, 100, 150, 199)


def train_config(job: str, mode_name: str, steps: int, seed: int = 0) -> Any:
    from roundpipe.train.config import TrainConfig

    lr_mult, lora_r, _ = JOBS[job]
    mode = Mode.parse(mode_name)
    base = TrainConfig().lr
    return TrainConfig(
        steps=steps,
        lr=base * lr_mult,
        lora_r=lora_r,
        seed=seed,
        max_grad_norm=mode.clip,
        async_optimizer=mode.async_optimizer,
        async_warmup_steps=mode.warmup,
        weight_prediction=mode.prediction if mode.async_optimizer else 0.0,
        async_lr_ramp_steps=mode.ramp_steps,
        async_lr_ramp_start=mode.ramp_start,
        fresh_layers=mode.fresh if mode.async_optimizer else 0,
        fresh_at=mode.fresh_at if mode.async_optimizer else (),
        fresh_at_if_fused=(),  # a mode is what its name says: freshat1 names the first block
    )


def reference_losses(config: Any, mode: Mode, device: str = "cpu") -> list[float]:
    """The plain loop: iteration t < warmup reads W_t; later ones W_{t-1}, plus each prediction
    factor times its update once that update was asynchronous; the async steps of the lr ramp
    run at its factor times the scheduled lr (and at ``mode.beta1`` when set); the gradient is
    clipped to ``max_grad_norm`` when set."""
    import torch

    from roundpipe.optim.host import host_adamw
    from roundpipe.optim.lr_ramp import ramp_factor
    from roundpipe.train.data import prepare_data
    from roundpipe.train.model import build_model, build_tokenizer
    from roundpipe.train.trainer import lr_factor

    torch.set_num_threads(1)
    tokenizer = build_tokenizer(config)
    batches = prepare_data(config, tokenizer).batches(0)  # the batches `roundpipe train` draws
    model = build_model(config, tokenizer).to(device)
    shadow = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    reads = [p for p in shadow.parameters() if p.requires_grad]
    fresh_ids = fresh_parameters(shadow, mode.fresh, mode.fresh_at) if config.async_optimizer else set()
    fresh = [id(p) in fresh_ids for p in reads]
    slow_ids = fresh_parameters(shadow, 0, mode.slow_at) if config.async_optimizer else set()
    slow = [id(p) in slow_ids for p in reads]
    groups = [[p for p, s in zip(params, slow, strict=True) if not s]]
    if any(slow):
        groups.append([p for p, s in zip(params, slow, strict=True) if s])
    # The same kernel as roundpipe train's (fused), which rounds differently from torch's default loop.
    opt = host_adamw([{"params": g} for g in groups], lr=config.lr, weight_decay=config.weight_decay)
    warmup = config.async_warmup_steps if config.async_optimizer else 0
    ramp = config.async_lr_ramp_steps if config.async_optimizer else 0

    def lr_multiplier(s: int, scale: float = 1.0) -> float:
        scaled = scale if s >= warmup else 1.0
        return lr_factor(config, s) * ramp_factor(s, warmup, ramp, config.async_lr_ramp_start) * scaled

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, [lr_multiplier, lambda s: lr_multiplier(s, mode.slow)][: len(groups)]
    )
    keep = len(mode.prediction) + 2
    history = [[p.detach().clone() for p in params]]  # W_0 .. W_t, the last ``keep`` of them
    losses = []
    for t in range(config.steps):
        with torch.no_grad():
            for i, read in enumerate(reads):
                if config.async_optimizer and (t < warmup or fresh[i]):
                    read.copy_(params[i])
                    continue
                at = -1 if not config.async_optimizer or t == 0 else -2  # W_t (sync) or W_{t-1}
                read.copy_(history[at][i])
                # + k_j (W_{t-j} - W_{t-j-1}) for the updates that exist and (async) were made
                # by a step of an asynchronous iteration's gradient, as the pipe's P-copy does;
                # on sync, the look-ahead control
                for j, factor in enumerate(mode.prediction):
                    older = at - j - 1
                    if -older > len(history) or (config.async_optimizer and t - 2 - j < warmup - 1):
                        break
                    read.add_(history[older + 1][i] - history[older][i], alpha=factor)
        shadow.zero_grad(set_to_none=True)
        batch = {k: v.to(device) for k, v in next(batches).items()}
        loss = shadow(**batch).loss
        loss.backward()
        for p, read in zip(params, reads, strict=True):
            assert read.grad is not None
            p.grad = read.grad.clone()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        if mode.beta1 is not None and config.async_optimizer and t >= warmup:
            for group in opt.param_groups:
                group["betas"] = (mode.beta1, group["betas"][1])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        history = [*history[-(keep - 1) :], [p.detach().clone() for p in params]]
        losses.append(loss.item())
    return losses


def fresh_parameters(model: Any, fresh_layers: int, at: tuple[int, ...] = ()) -> set[int]:
    """The ids of the parameters `RunConfig.fresh_layers` and `RunConfig.fresh_at` read fresh:
    those of the units `fresh_units_of` picks among the pipe's layers, found as the pipe's
    `HostModel` finds them (`trainable_units`, without building one: that would rebind the frozen
    parameters)."""
    from roundpipe.model.sequence import to_layer_sequence
    from roundpipe.optim.host import trainable_units
    from roundpipe.sched.spec import fresh_units_of

    if not fresh_layers and not at:
        return set()
    layers = to_layer_sequence(model).layers
    _, unit_params, owners = trainable_units([list(layer.named_parameters()) for layer in layers])
    return {id(p) for unit in fresh_units_of(tuple(owners), fresh_layers, at) for p in unit_params[unit]}


def pipe_losses(config: Any) -> list[float]:
    from roundpipe.train.trainer import train

    with tempfile.TemporaryDirectory() as out:
        result = train(config.model_copy(update={"out": out, "name": "run"}))
    return list(result.losses)


def run_one(
    engine: str, job: str, mode: str, steps: int, seed: int = 0, device: str = "cpu"
) -> dict[str, Any]:
    config = train_config(job, mode, steps, seed)
    parsed = Mode.parse(mode)
    if engine == "pipe" and not parsed.pipe_supported:
        raise ValueError(
            f"mode {mode!r} is an experiment of the reference engine only: `roundpipe train` has no such mode"
        )
    started = time.perf_counter()
    losses = reference_losses(config, parsed, device) if engine == "reference" else pipe_losses(config)
    return {
        "bench": "async_quality",
        "engine": engine,
        "device": device,
        "job": job,
        "mode": mode,
        "seed": seed,
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
    """One panel per job, one curve per mode: the 10-step mean of the loss, averaged over the
    seeds the results hold (each mode's curve over the same seeds as its sync run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = sorted({r["job"] for r in results}, key=lambda job: list(JOBS).index(job) if job in JOBS else 99)
    modes = list(dict.fromkeys([*MODES, *(r["mode"] for r in results)]))
    fig, axes = plt.subplots(1, len(jobs), figsize=(5 * len(jobs), 4), squeeze=False)
    for ax, job in zip(axes[0], jobs, strict=True):
        runs = [r for r in results if r["job"] == job]
        curves = []
        for mode in dict.fromkeys(r["mode"] for r in sorted(runs, key=sort_key)):
            group = [smoothed(r["losses"]) for r in runs if r["mode"] == mode]
            mean = [sum(values) / len(values) for values in zip(*group, strict=True)]
            curves.append(mean)
            finals = [r["final"] for r in runs if r["mode"] == mode]
            ax.plot(
                mean,
                label=f"{mode} ({sum(finals) / len(finals):.3f}, {len(finals)} seeds)",
                color=f"C{modes.index(mode) % 10}",  # one colour per mode in every panel
                linewidth=1.2,
            )
        ax.set_title(f"{job} (peak lr {runs[0]['lr']:.2g})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (10-step mean)")
        low = min(min(curve) for curve in curves) - 0.1
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
    for r in sorted(results, key=sort_key):
        gap = f"{r['vs_sync']:+.1%}" if "vs_sync" in r and r["mode"] != "sync" else ""
        tail_gap = f"{r['tail_vs_sync']:+.1%}" if "tail_vs_sync" in r and r["mode"] != "sync" else ""
        lines.append(f"| {r['job']} | {r['mode']} | {r['final']:.3f} | {gap} | {tail(r):.3f} | {tail_gap} |")
    return "\n".join(lines)


def sort_key(result: dict[str, Any]) -> tuple[int, int, str, int]:
    order = {job: i for i, job in enumerate(JOBS)}
    modes = {mode: i for i, mode in enumerate(MODES)}
    mode = result["mode"]
    return (order.get(result["job"], 99), modes.get(mode, 99), mode, result.get("seed", 0))


def seed_table(results: list[dict[str, Any]]) -> str:
    """Per job and mode over the seeds: the mean paired gap to sync (each seed against its own
    sync run), its standard error and the worst seed, for the final loss and the last-20 mean."""
    lines = [
        "| job | mode | seeds | final vs sync: mean ± se | worst seed | last 20 vs sync: mean ± se | worst seed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in sorted(results, key=sort_key):
        if r["mode"] != "sync" and "vs_sync" in r:
            groups.setdefault((r["job"], r["mode"]), []).append(r)

    def summary(values: list[float]) -> tuple[str, str]:
        se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
        return f"{statistics.mean(values):+.2%} ± {se:.2%}", f"{max(values):+.2%}"

    for (job, mode), runs in groups.items():
        final, final_worst = summary([r["vs_sync"] for r in runs])
        last, last_worst = summary([r["tail_vs_sync"] for r in runs])
        lines.append(f"| {job} | {mode} | {len(runs)} | {final} | {final_worst} | {last} | {last_worst} |")
    return "\n".join(lines)


def tail(result: dict[str, Any], steps: int = 20) -> float:
    """Mean loss of the last ``steps`` steps: the final loss is one batch, and a trajectory that
    differs by one step early on ends a few hundredths away by chance alone."""
    last = result["losses"][-steps:]
    return sum(last) / len(last)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("pipe", "reference"), default="pipe")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", nargs="*", default=None, help="job names, or job:mode")
    parser.add_argument(
        "--modes",
        nargs="*",
        default=None,
        help="run these modes (names as Mode.parse reads them) for every job",
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=[0], help="a run per seed (default 0)")
    parser.add_argument("--device", default="cpu", help="torch device of the reference engine (cpu, cuda)")
    parser.add_argument("--png", default=None, help="draw the curves (mean over the seeds) into this PNG")
    parser.add_argument("--plot-modes", nargs="*", default=None, help="only these modes in the PNG")
    parser.add_argument("--json", default=None, help="also write every result (with curves) here")
    parser.add_argument("--load", nargs="*", default=(), help="results of earlier --json runs to include")
    args = parser.parse_args(argv)
    runs = [
        (job, mode)
        for job, (_, _, modes) in JOBS.items()
        for mode in (modes if args.modes is None else ("sync", *(m for m in args.modes if m != "sync")))
    ]
    if args.only is not None:
        runs = [(j, m) for j, m in runs if j in args.only or f"{j}:{m}" in args.only]
    for _, mode in runs:
        Mode.parse(mode)  # a misspelt mode fails before any run
    results: list[dict[str, Any]] = [r for path in args.load for r in json.loads(Path(path).read_text())]
    # spawn: a CUDA reference engine cannot run in a forked child of a process that imported torch.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=context) as pool:
        futures = [
            pool.submit(run_one, args.engine, job, mode, args.steps, seed, args.device)
            for seed in args.seeds
            for job, mode in runs
        ]
        for future in futures:
            results.append(future.result())
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
            if args.json:  # written as the runs end: a run cut short keeps what finished
                Path(args.json).write_text(json.dumps(results) + "\n")
    for result in results:
        sync = next(
            (
                r
                for r in results
                if r["job"] == result["job"]
                and r["mode"] == "sync"
                and r.get("seed", 0) == result.get("seed", 0)
            ),
            None,
        )
        if sync is not None:
            result["vs_sync"] = round(result["final"] / sync["final"] - 1, 4)
            result["tail_vs_sync"] = round(tail(result) / tail(sync) - 1, 4)
    if len({r.get("seed", 0) for r in results}) > 1:
        print(seed_table(results))
    else:
        print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results) + "\n")
    if args.png:
        shown = [r for r in results if args.plot_modes is None or r["mode"] in args.plot_modes]
        plot(shown, args.png)
        print(f"curves: {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
