"""GPU throughput: roundpipe against the plain GPU-resident loop, per workload, in one run.

Why one script for every workload of the GPU targets: device time is short, so one call must
give every figure the targets are judged by (tokens/s, peak GPU memory per device, the planner's
prediction, bubble and exposed transfer from the trace) for roundpipe in sync and async mode and,
in a separate process so its memory does not mix, for the plain loop (the whole model on one
device in bf16 with gradient checkpointing and fused AdamW). One JSON line per (workload, mode),
also appended to ``--out``; a short table at the end.

    python bench/gpu_throughput.py --workload A,B --devices cuda:0 --out runs.jsonl
    python bench/gpu_throughput.py --workload tiny --devices cpu:2 --steps 2   # smoke run, no GPU

A configuration that fails (out of memory, a plan that cannot fit) prints its line with the
error and the run goes on: this script must never lose the figures of the other workloads.

Under torchrun it measures data parallel across processes (docs/distributed.md): every process
trains the workload's batch as its share of a global batch P times larger, on its share of the
machine's GPUs (``--devices cuda``), averaging gradients with the others; rank 0 alone prints,
with ``tokens_per_s`` over all processes. The plain loop is then not run (it is one process: run
the same command without torchrun for it and for the one-process figure).

    torchrun --standalone --nproc-per-node 2 bench/gpu_throughput.py --workload A --async --no-plain
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch

# The sibling module, also when this file is imported (tests): appended, so nothing in bench/
# shadows an installed module of the same name.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

from compile_log import compile_events
from gpu_link import h2d_probe_gbps, link_figures, model_upload_bytes, param_up_rates
from gpu_memory_snapshot import recorded
from gpu_throughput_run import (
    SDPA_BACKENDS,
    RssSampler,
    Shape,
    Workload,
    adamw,
    allocated_memory,
    attention_backend,
    build_model,
    cuda_indices,
    device_memory,
    device_names,
    make_batch,
    model_dtype,
    parse_size,
    predicted_memory,
    reset_peaks,
    run_plain,
    versions,
)
from host_probe import host_probe
from torch_profile import profiled

QWEN3_1_7B = Shape(28, 2048, 6144, 16, 8, 128, 151936, True)
QWEN3_14B = Shape(40, 5120, 17408, 40, 8, 128, 151936, False)
QWEN3_32B = Shape(64, 5120, 25600, 64, 8, 128, 151936, False)
LLAMA_70B = Shape(80, 8192, 28672, 64, 8, 128, 128256, False, family="llama")
LLAMA_8B = Shape(32, 4096, 14336, 32, 8, 128, 128256, False, family="llama")
# Mixtures of experts: ``intermediate`` is each expert's.
QWEN3_30B_A3B = Shape(48, 2048, 768, 32, 4, 128, 151936, False, "qwen3_moe", 128, 8)
GPT_OSS_20B = Shape(24, 2880, 2880, 64, 8, 64, 201088, False, "gpt_oss", 32, 4, sliding_window=128)
TINY = Shape(4, 64, 128, 4, 2, 16, 256, True)
G_SEQ = 262144


def big(name: str, shape: Shape, batch: int, seq: int, microbatches: int, **kw: Any) -> Workload:
    """A workload of the big-model targets: LoRA r16 on q/k/v/o under 24 GiB, built a layer at a
    time on the GPU (`gpu_models.build_layerwise`)."""
    return Workload(name, shape, batch, seq, microbatches, lora_r=16, budget="24GiB", layerwise=True, **kw)


WORKLOADS = {
    "A": Workload("A", QWEN3_1_7B, 8, 4096, 8),
    "B": Workload("B", QWEN3_1_7B, 32, 2048, 4),
    "C": Workload("C", QWEN3_14B, 4, 4096, 4, lora_r=16, budget="24GiB"),
    "long": Workload("long", QWEN3_1_7B, 1, 131072, 1, budget="24GiB", recompute_grain="layer"),
    "E": big("E", QWEN3_32B, 4, 4096, 4),
    "E-nf4": big("E-nf4", QWEN3_32B, 4, 4096, 4, base_format="nf4"),
    # Stage grain, as "auto" runs F on a host of 64 GiB (its target): on a larger host it would save
    # its 20 GiB of layer inputs there too (roundpipe/planning/grain.py; F-inputs runs that).
    "F": big("F", LLAMA_70B, 4, 4096, 4, base_format="nf4", recompute_grain="stage"),
    "G": big("G", LLAMA_8B, 1, G_SEQ, 1, recompute_grain="layer"),
    "G-nf4": big("G-nf4", LLAMA_8B, 1, G_SEQ, 1, recompute_grain="layer", base_format="nf4"),
    "D": big("D", QWEN3_30B_A3B, 4, 4096, 4),
    "D16": big("D16", QWEN3_30B_A3B, 16, 4096, 16),
    "D2": big("D2", GPT_OSS_20B, 4, 4096, 4),
    "tiny": Workload("tiny", TINY, 4, 32, 2),
}
SHAPE_FLAGS = (
    "layers",
    "hidden",
    "intermediate",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "experts",
    "experts_per_token",
    "sliding_window",
)


def plain_cannot_hold(workload: Workload) -> str | None:
    """Why the plain loop cannot run under the budget (its bf16 base weights, plus the LoRA
    parameters with their gradients and two AdamW states, do not fit; or transformers' loss, which
    makes a microbatch's whole logits in bf16 and again in fp32, does not), or None."""
    if workload.budget is None:
        return None
    budget = parse_size(workload.budget)
    base = 2 * workload.shape.param_count() + 8 * workload.lora_param_count()
    if base > budget:
        return f"cannot hold the base in {workload.budget}"
    logits = workload.tokens // workload.microbatches * workload.shape.vocab * (2 + 4)
    return None if base + logits <= budget else f"cannot hold the logits in {workload.budget}"


# --------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--workload", action="append", help=f"{', '.join(WORKLOADS)} (repeatable, or a comma list)"
    )
    for name in SHAPE_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None, help="tie embeddings")
    p.add_argument("--family", choices=("qwen3", "llama", "qwen3_moe", "gpt_oss"))
    p.add_argument("--base-format", choices=("bf16", "nf4"), help="frozen base of the decoder layers")
    p.add_argument(
        "--layerwise",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build one layer at a time on the device (the big workloads do)",
    )
    p.add_argument(
        "--probe", action=argparse.BooleanOptionalAction, default=True, help="time a pinned H2D copy"
    )
    p.add_argument("--lora-r", type=int, help="peft LoRA rank on q/k/v/o (0: full fine-tuning)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--microbatches", type=int)
    p.add_argument("--budget", help='per-device memory budget, e.g. "24GiB" ("none" lifts a default)')
    p.add_argument("--recompute-grain", choices=("auto", "stage", "layer", "layer_input"))
    p.add_argument(
        "--profile", choices=("every_layer", "one_per_kind"), help="RunConfig.profile (default: its default)"
    )
    p.add_argument("--chunk-bytes", help='RunConfig.chunk_bytes, the largest upload piece, e.g. "256MiB"')
    p.add_argument(
        "--one-device-stages",
        choices=("balanced", "coarse"),
        help="how a one-GPU plan cuts its stages (roundpipe.planning.device_plan.STAGES_ON_ONE_DEVICE)",
    )
    p.add_argument(
        "--backward-stage-layers",
        type=int,
        help="the most layers of a coarse one-GPU plan's backward stage "
        "(roundpipe.planning.device_plan.BACKWARD_STAGE_LAYERS; default: as many as fit)",
    )
    p.add_argument(
        "--flow-depth",
        type=int,
        help="microbatches a stage's inputs go ahead of its computes where the plan fits "
        "(roundpipe.planning.device_plan.FLOW_DEPTH, default 2)",
    )
    p.add_argument(
        "--choice-sum",
        choices=("auto", "on", "off"),
        default="auto",
        help="sum each token's expert rows by the Triton kernels (roundpipe.model.choice_sum.ENABLED; "
        "auto: where CUDA and Triton are)",
    )
    p.add_argument(
        "--upload-parts-ahead",
        type=int,
        help="parameter upload parts a run keeps on the link at once "
        "(roundpipe.assembly.UPLOAD_PARTS_AHEAD; default: no limit)",
    )
    p.add_argument(
        "--compile",
        choices=("auto", "true", "false"),
        help="RunConfig.compile (default: its default, auto); false runs the layers eagerly",
    )
    p.add_argument(
        "--skip-unread-tail",
        choices=("true", "false"),
        help="RunConfig.skip_unread_tail (default: its default, true); false recomputes every "
        "layer's frozen down projection",
    )
    p.add_argument(
        "--save-residuals",
        choices=("true", "false"),
        help="RunConfig.save_residuals (default: its default, true); false saves each layer's input "
        "without its post-attention residual under layer_input, so recomputes compute o_proj",
    )
    p.add_argument(
        "--dequantize",
        choices=("auto", "run", "call"),
        help='RunConfig.dequantize (default: its default, "auto", which may leave one device\'s fused '
        'stage per call); "run": every stage run holds dense copies',
    )
    p.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a torch._inductor.config setting for this run (repeatable; set back after it), "
        "e.g. combo_kernels=True: fewer kernel launches for a host-bound layer",
    )
    p.add_argument(
        "--sdpa-first",
        choices=tuple(SDPA_BACKENDS),
        help="the sdpa backend torch tries first for this run (torch.nn.attention.sdpa_kernel with "
        "set_priority, set back after it; any but cudnn also turns cuDNN attention off for the "
        "run; default: torch's own choice): flash against cudnn",
    )
    p.add_argument("--devices", default="cuda", help='"cuda", "cuda:0,1" or "cpu:2"')
    p.add_argument("--sync", action="store_true", help="run sync mode (default: both modes)")
    p.add_argument("--async", action="store_true", dest="run_async", help="run async mode")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument(
        "--loss-lag",
        type=int,
        choices=(0, 1),
        default=0,
        help="read each loss this many steps late (forward_backward(wait=False); roundpipe train's default is 1)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="steps before measuring at least (more until the re-plan has run an iteration: `settled`)",
    )
    p.add_argument(
        "--torch-profile",
        action="store_true",
        help="profile the measured steps with torch.profiler (bench/torch_profile.py); slows them",
    )
    p.add_argument(
        "--memory-snapshot",
        type=Path,
        default=None,
        metavar="DIR",
        help="record the allocator's history over the measured steps and write where the peak's "
        "bytes were to DIR/memory_summary.json (bench/gpu_memory_snapshot.py; CUDA only); slows them",
    )
    p.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--collect-garbage",
        action="store_true",
        help="run Python's cycle collector after every step (is device memory held by garbage?)",
    )
    p.add_argument("--model-dtype", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    p.add_argument(
        "--save-trace",
        type=Path,
        metavar="DIR",
        help="write each roundpipe run's trace to DIR/<workload>-<mode>.trace.json.gz (with the plan and layer costs)",
    )
    p.add_argument("--plain-child", help=argparse.SUPPRESS)  # the plain loop's own process
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"need --steps >= 1 and --warmup >= 0 (got {args.steps}, {args.warmup})")
    names = [n.strip() for item in args.workload or ["A"] for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    args.workloads = [apply_overrides(WORKLOADS[n], args) for n in dict.fromkeys(names)]
    args.modes = [m for m, on in (("sync", args.sync), ("async", args.run_async)) if on] or ["sync", "async"]
    return args


def apply_overrides(workload: Workload, args: argparse.Namespace) -> Workload:
    shape = {n: getattr(args, n) for n in SHAPE_FLAGS if getattr(args, n) is not None}
    if args.tied is not None:
        shape["tied"] = args.tied
    if args.family is not None:
        shape["family"] = args.family
    names = ("batch", "seq", "microbatches", "lora_r", "recompute_grain", "base_format", "layerwise")
    run = {n: getattr(args, n) for n in names}
    run = {n: v for n, v in run.items() if v is not None}
    if args.budget is not None:
        run["budget"] = None if args.budget.lower() == "none" else args.budget
        if run["budget"] is not None:
            parse_size(run["budget"])  # fail now, not after the first workload ran
    return replace(workload, shape=replace(workload.shape, **shape), **run)


# --------------------------------------------------------------------- roundpipe side


def budget_route(workload: Workload) -> dict[str, Any]:
    """Which RunConfig field carries the budget: ``memory_budget`` where RunConfig has it, else
    ``mem_limit_bytes`` (which bounds parameter bytes per stage pair only: the line says so)."""
    import roundpipe

    if workload.budget is None:
        return {"budget_field": None}
    if "memory_budget" in roundpipe.RunConfig.model_fields:
        return {"budget_field": "memory_budget"}
    note = "RunConfig has no memory_budget field: the budget was passed as mem_limit_bytes"
    return {"budget_field": "mem_limit_bytes", "budget_note": note}


def make_config(workload: Workload, mode: str, args: argparse.Namespace) -> Any:
    import roundpipe

    fields: dict[str, Any] = dict(
        devices=args.devices,
        num_microbatches=workload.microbatches,
        precision="bf16",
        async_optimizer=mode == "async",
        recompute_grain=workload.recompute_grain,
        trace_iterations=args.warmup + args.steps + 1,
        loss_lag=getattr(args, "loss_lag", 0),  # planned for the loop that runs
    )
    if workload.base_format != "bf16" and "base_format" in roundpipe.RunConfig.model_fields:
        fields["base_format"] = workload.base_format
    if getattr(args, "profile", None):
        fields["profile"] = args.profile
    if getattr(args, "chunk_bytes", None):
        fields["chunk_bytes"] = parse_size(args.chunk_bytes)
    if getattr(args, "compile", None):
        fields["compile"] = {"auto": "auto", "true": True, "false": False}[args.compile]
    if getattr(args, "skip_unread_tail", None) and "skip_unread_tail" in roundpipe.RunConfig.model_fields:
        fields["skip_unread_tail"] = args.skip_unread_tail == "true"
    if getattr(args, "save_residuals", None) and "save_residuals" in roundpipe.RunConfig.model_fields:
        fields["save_residuals"] = args.save_residuals == "true"
    if getattr(args, "dequantize", None):
        fields["dequantize"] = args.dequantize
    route = budget_route(workload)["budget_field"]
    if route is None:
        return roundpipe.RunConfig(**fields)
    if route == "mem_limit_bytes":
        return roundpipe.RunConfig(**fields, mem_limit_bytes=parse_size(workload.budget or ""))
    try:
        return roundpipe.RunConfig(**fields, memory_budget=workload.budget)
    except roundpipe.ConfigError:  # a budget field that takes a number of bytes only
        return roundpipe.RunConfig(**fields, memory_budget=parse_size(workload.budget or ""))


def run_roundpipe(
    workload: Workload, mode: str, args: argparse.Namespace, model: torch.nn.Module
) -> dict[str, Any]:
    """Warm-up steps, then measured steps of ``model`` (which the run trains: pass a copy)."""
    import torch._inductor.config as inductor_config

    import roundpipe
    from roundpipe.backends.compiling import settings_everywhere
    from roundpipe.sched.breakdown import breakdown
    from roundpipe.sched.gaps import find_gaps, gap_causes

    indices = cuda_indices(args.devices)
    config = make_config(workload, mode, args)
    data = make_batch(workload)
    probe = h2d_probe_gbps(indices[0] if indices and getattr(args, "probe", True) else None)
    optimizers: list[str] = []
    reset_peaks(indices)
    times: list[float] = []
    losses: list[float] = []
    waiting: list[Any] = []  # `PendingLoss`es not read yet
    profiling = contextlib.ExitStack()  # --torch-profile: entered with the measured steps
    torch_profile: dict[str, Any] | None = None
    memory_snapshot: dict[str, Any] | None = None  # --memory-snapshot: entered likewise
    discarded: list[dict[str, Any]] = []  # measured windows a compile fell into, measured again
    planner = planner_settings(args)
    inductor_options = parse_inductor_options(getattr(args, "inductor", []))
    with (
        mock.patch.multiple("roundpipe.planning.device_plan", **planner),
        upload_window(getattr(args, "upload_parts_ahead", None)),
        choice_sum_kernels(getattr(args, "choice_sum", "auto")),
        settings_everywhere(inductor_config, inductor_options),  # the lanes compile on their own threads
        # roundpipe holds the C++ wrapper on CUDA unless the environment chose: --inductor
        # cpp_wrapper=False is the Python wrapper's A/B
        mock.patch.dict(os.environ, cpp_wrapper_environ(inductor_options)),
        sdpa_priority(getattr(args, "sdpa_first", None)),  # traced into the compiled layers
        RssSampler() as rss,
        compile_events() as compiles,
        roundpipe.RoundPipe(model, optimizer=adamw(optimizers), config=config) as pipe,
    ):
        progress(f"{workload.name} {mode}: pipe open, {pipe.plan.num_slots} slots")
        warm_peaks: dict[str, float] = {}
        retries_before = alloc_retries(indices)
        pinned_before = pinned_host_growth()
        compile_before = compile_seconds()
        first, measured_start = 0, time.perf_counter()
        warmup = args.warmup
        i = 0
        plans_run: list[Any] = []  # the plan each step's iteration was built with
        remeasures = 0 if profiled_window(args) else REMEASURES_AFTER_COMPILE
        while True:
            while i < warmup + args.steps:
                if (
                    i == warmup
                    and 0 < warmup < args.warmup + MAX_SETTLING_STEPS
                    and not settled(pipe, plans_run)
                ):
                    warmup += 1  # the measured steps start after the iteration that compiles the re-plan
                if i == warmup:
                    losses += [pending.result() for pending in waiting]
                    waiting.clear()
                    pipe.synchronize()
                    warm_peaks = device_memory(indices)
                    reset_peaks(indices)
                    retries_before = alloc_retries(indices)
                    pinned_before = pinned_host_growth()
                    compile_before = compile_seconds()
                    first, measured_start = pipe.iteration_count, time.perf_counter()
                    if getattr(args, "torch_profile", False):
                        torch_profile = profiling.enter_context(profiled(args.steps))
                    if getattr(args, "memory_snapshot", None) is not None and indices:
                        memory_snapshot = profiling.enter_context(recorded(args.memory_snapshot))
                start = time.perf_counter()
                plans_run.append(pipe.plan)  # re-plans happen between iterations, never inside one
                waiting.append(pipe.forward_backward(data, wait=False))
                # No synchronize per step, in either mode: it also writes the weights back into the
                # module (seconds for a large model in bf16). In sync mode the next iteration's
                # uploads wait for this step's P-copy, so the step still counts in the step time.
                pipe.step()
                while len(waiting) > args.loss_lag:  # with a lag, the previous step's loss
                    losses.append(waiting.pop(0).result())
                if args.collect_garbage:
                    gc.collect()
                times.append(time.perf_counter() - start)
                i += 1
                progress(
                    f"{workload.name} {mode}: step {i}/{warmup + args.steps} in {times[-1]:.1f} s"
                    + " (warm-up)" * (i <= warmup)
                )
            losses += [pending.result() for pending in waiting]
            pipe.synchronize()
            wall = time.perf_counter() - measured_start
            compiled_s = compile_seconds() - compile_before
            if compiled_s <= 0 or remeasures == 0:
                break
            # A compile inside the measured steps is warm-up the settling did not foresee: the
            # window is measured again after it, and the line keeps what the first one paid.
            remeasures -= 1
            discarded.append(
                {
                    "compile_s": round(compiled_s, 3),
                    "tokens_per_s_wall": wall_rate(workload.tokens, args.steps, wall),
                    "compiles": compiles.since(measured_start),
                }
            )
            progress(
                f"{workload.name} {mode}: {compiled_s:.1f} s compiling in the measured steps, measured again"
            )
            warmup = i
        profiling.close()
        trace = pipe.trace()
        flow_depth = trace.meta.get("flow_depth")  # the depth the run's graph used
        measured = range(first, pipe.iteration_count)
        report = breakdown(trace, measured)
        causes = gap_causes(find_gaps(trace, measured)) if len(measured) else {}
        if args.save_trace is not None:
            trace.save(args.save_trace / f"{workload.name}-{mode}.trace.json.gz")
        predicted = predicted_memory(pipe)
        upload_bytes = model_upload_bytes(pipe)
        plan = pipe.plan
        attention = attention_backend(workload.shape, pipe.runtime.device(0))  # under the run's order
        backend = pipe._backend  # CUDA: each device's clock map (`CudaBackend.clock_statistics`)
        clocks = {
            f"cuda:{backend.device_indices[d]}": c  # type: ignore[attr-defined]
            for d, c in getattr(backend, "clock_statistics", dict)().items()
        }
    peaks = device_memory(indices)
    retries = alloc_retries(indices)
    step_s = sorted(times[warmup:])[len(times[warmup:]) // 2]
    if args.loss_lag:
        # A loop iteration that reads the previous step's loss returns when that loss is in, which
        # is not when a step ends (and the first measured one reads none): the period is the
        # measured steps' wall time, their last backward and the final synchronize included.
        step_s = wall / args.steps
    # Every process trains the workload's tokens per step, and they step together (each step
    # waits for the gradients of all): the global rate is the processes' count times one's.
    world = processes()[1]
    link = link_figures(
        trace,
        report.iterations,
        report.window_ms,
        upload_bytes,
        probe,
        workload.tokens,
        workload.tokens / step_s,
    )
    return {
        "tokens_per_s": round(world * workload.tokens / step_s, 1),
        "tokens_per_s_wall": wall_rate(workload.tokens, args.steps, wall),  # + one final synchronize
        # Over the measured iterations' tasks only (first compute start to last compute end): with
        # --warmup 0 the step above also holds the one-time device profile and compiles.
        "tokens_per_s_trace": round(
            world * workload.tokens * len(report.iterations) / max(report.span_ms / 1000, 1e-9), 1
        ),
        "processes": world,
        "tokens_per_process_step": workload.tokens,
        "step_s_median": round(step_s, 4),
        "peak_gib": peaks,
        "run_peak_gib": {d: round(max(v, warm_peaks.get(d, 0.0)), 3) for d, v in peaks.items()},
        "alloc_retries": retries,  # whole process: profiling and warm-up included
        "alloc_retries_measured": {d: n - retries_before[d] for d, n in retries.items()},
        # torch.compile's time inside the measured steps: above 0, their figures paid for it.
        "compile_s_measured": round(compiled_s, 3),
        "compiles_measured": compiles.since(measured_start),  # what compiled then (bench/compile_log.py)
        "remeasured_after_compile": discarded,
        # Pinned host blocks the measured steps had to create (activation downloads land in them).
        "pinned_host_growth": {k: round(v - pinned_before[k], 3) for k, v in pinned_host_growth().items()},
        **predicted,
        "slots": plan.num_slots,
        "plan": str(plan).splitlines()[0],
        "bubble": round(report.bubble, 5),
        # The trace's times come through a map from each GPU's clock to the host's; what the map
        # took from the tasks' lengths (whole run) would read as bubble: it should stay near 0.
        "device_clock": {
            name: {"tasks": c.tasks, "lost_ms": round(c.lost_ms, 3), "shift_ms": round(c.shift_ms, 3)}
            for name, c in clocks.items()
        },
        "exposed_transfer": round(report.exposed_transfer, 5),
        "host_bound": round(report.host_bound, 5),
        **link,
        "planner_link": trace.meta.get("link"),  # the re-plan's own view of the link, where it made one
        "param_up_gbps": param_up_rates(trace),  # per iteration: the planner's median, summed spans, union
        "long_row_slicing": trace.meta.get("long_row_slicing"),  # the least slicing that fit, if long
        "prefetch_stages": trace.meta.get("prefetch_stages"),  # stages uploaded ahead, as last planned
        "dense_weights": trace.meta.get("dense_weights"),  # 4-bit weights dense once a stage run
        "dense_per_call_layers": trace.meta.get("dense_per_call_layers"),  # but these (a fused stage)
        "recompute_grain": trace.meta.get("recompute_grain"),  # the grain the device plan was made at
        "recompute_grain_why": trace.meta.get("recompute_grain_why"),  # and why ("auto" chose, or named)
        # Each layer's forward and backward ms as the profile measured them and as the re-plan
        # scaled them to the device's timing: a layer timed compiling stands out here.
        "layer_ms": layer_ms(trace.meta),
        "slowest_computes": slowest_computes(trace),  # a compile inside a timed iteration shows here
        "busy_ms_per_step": {k: round(v, 2) for k, v in sorted(report.busy_ms_per_iteration.items())},
        "breakdown": report.to_dict(),
        "host_rss_gib": rss.report(),
        "optimizer": sorted(set(optimizers)),
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "losses": [round(x, 4) for x in losses],  # every step's, warm-up included
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "loss_lag": args.loss_lag,
        "warmup_steps": warmup,  # --warmup, plus the steps until the re-plan had run
        "profile": getattr(config, "profile", None),
        "chunk_bytes": config.chunk_bytes,
        "compile": config.compile,
        "skip_unread_tail": getattr(config, "skip_unread_tail", None),
        "save_residuals": trace.meta.get("layer_residuals"),  # whether the plan saved them
        "one_device_stages": planner["STAGES_ON_ONE_DEVICE"],
        "backward_stage_layers": planner.get("BACKWARD_STAGE_LAYERS"),
        "inductor": inductor_options,
        "sdpa_first": getattr(args, "sdpa_first", None),
        "attention_backend": attention,
        "flow_depth": flow_depth,
        "upload_parts_ahead": trace.meta.get("upload_parts_ahead"),
        "choice_sum": getattr(args, "choice_sum", "auto"),
        # the measured iterations' idle gaps by cause (`roundpipe trace gaps` lists each), per iteration
        "gap_causes_ms": {k: round(v / max(1, len(measured)), 2) for k, v in causes.items()},
        **({"torch_profile": torch_profile} if torch_profile is not None else {}),
        **({"memory_snapshot": memory_snapshot} if memory_snapshot is not None else {}),
    }


def layer_ms(meta: dict[str, Any]) -> dict[str, list[float]] | None:
    """The profiled and the planned (re-planned) per-layer times in a trace's metadata, rounded."""
    profiled, planned = meta.get("profiled_layer_costs"), meta.get("layer_costs")
    if not isinstance(profiled, dict) or not isinstance(planned, dict):
        return None
    pairs = {
        "profiled_fwd": profiled.get("fwd_ms"),
        "profiled_bwd": profiled.get("bwd_ms"),
        "fwd": planned.get("fwd_ms"),
        "bwd": planned.get("bwd_ms"),
    }
    return {k: [round(float(ms), 3) for ms in v] for k, v in pairs.items() if isinstance(v, list)}


def slowest_computes(trace: Any, count: int = 6) -> list[dict[str, Any]]:
    """The longest compute and recompute tasks of the whole run, iteration 0 included (it
    compiles), with where they ran: the re-plan scales its costs to iterations from 1 on, so a
    compile there would skew every layer's planned time."""
    computes = [t for t in trace if t.kind in ("compute", "recompute") and t.end_t >= t.start_t]
    longest = sorted(computes, key=lambda t: t.end_t - t.start_t, reverse=True)[:count]
    return [
        {
            "ms": round(t.end_t - t.start_t, 2),
            "kind": t.kind,
            "stage_kind": t.stage_kind,
            "iteration": t.iteration,
            "slot": t.slot,
            "microbatch": t.microbatch,
            "layers": [t.layers.start, t.layers.stop],
        }
        for t in longest
    ]


def sdpa_priority(first: str | None) -> contextlib.AbstractContextManager[Any]:
    """torch's sdpa backends with ``first`` in front, for the run (process-wide, so every lane's
    thread reads it, and read when a layer is traced, so it holds the compiled layers' choice
    too). Any backend but cuDNN first also leaves cuDNN attention off: torch on a Hopper card
    with a recent cuDNN installs its own cuDNN-first order at the first attention call, which
    an order set before that call does not survive. ``None``: torch's own choice, untouched."""
    if first is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    others = [b for n, b in SDPA_BACKENDS.items() if n != first and (first == "cudnn" or n != "cudnn")]
    return sdpa_kernel([SDPA_BACKENDS[first], *others], set_priority=True)


def cpp_wrapper_environ(inductor_options: dict[str, Any]) -> dict[str, str]:
    """The environment that leaves inductor's C++ wrapper to ``--inductor cpp_wrapper=...``
    (`roundpipe.backends.compiling.wants_cpp_wrapper` defers to ``TORCHINDUCTOR_CPP_WRAPPER``)."""
    if "cpp_wrapper" not in inductor_options:
        return {}
    return {"TORCHINDUCTOR_CPP_WRAPPER": "1" if inductor_options["cpp_wrapper"] else "0"}


def parse_inductor_options(pairs: list[str]) -> dict[str, Any]:
    """``--inductor KEY=VALUE`` pairs as torch._inductor.config settings: the value as a Python
    literal (True, 3, 0.5, "x"), else the string; a key inductor does not have is an error."""
    import ast

    import torch._inductor.config as inductor_config

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--inductor takes KEY=VALUE (e.g. combo_kernels=True), not {pair!r}")
        if not hasattr(inductor_config, key):
            raise SystemExit(f"--inductor {key}: torch._inductor.config has no setting {key!r}")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def planner_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's process-wide choices for one run (`device_plan.STAGES_ON_ONE_DEVICE`,
    `BACKWARD_STAGE_LAYERS`, `FLOW_DEPTH`), from --one-device-stages, --backward-stage-layers and
    --flow-depth or as they are: settings of the process, not of the run's config, so the run
    patches them and sets them back."""
    from roundpipe.planning import device_plan

    stages = getattr(args, "one_device_stages", None)
    backward = getattr(args, "backward_stage_layers", None)
    depth = getattr(args, "flow_depth", None)
    settings = {
        "STAGES_ON_ONE_DEVICE": device_plan.STAGES_ON_ONE_DEVICE if stages is None else stages,
        "FLOW_DEPTH": device_plan.FLOW_DEPTH if depth is None else depth,
    }
    if hasattr(device_plan, "BACKWARD_STAGE_LAYERS"):  # an older tree (gpu_regress.sh) has none
        settings["BACKWARD_STAGE_LAYERS"] = (
            device_plan.BACKWARD_STAGE_LAYERS if backward is None else backward
        )
    return settings


def upload_window(parts: int | None) -> contextlib.AbstractContextManager[Any]:
    """``roundpipe.assembly.UPLOAD_PARTS_AHEAD`` for one run (--upload-parts-ahead), set back after
    it; nothing where not given (an older tree, `gpu_regress.sh`, has no such setting)."""
    if parts is None:
        return contextlib.nullcontext()
    return mock.patch("roundpipe.assembly.UPLOAD_PARTS_AHEAD", parts)


def choice_sum_kernels(choice: str) -> contextlib.AbstractContextManager[Any]:
    """``roundpipe.model.choice_sum.ENABLED`` for one run (--choice-sum on|off), set back after it;
    nothing for "auto" (the library's default)."""
    if choice == "auto":
        return contextlib.nullcontext()
    return mock.patch("roundpipe.model.choice_sum.ENABLED", choice == "on")


def wall_rate(tokens_per_step: int, steps: int, wall_s: float) -> float:
    """Tokens per second of all processes over ``steps`` measured steps taking ``wall_s`` in all
    (every process trains a step's tokens, and they step together)."""
    return round(processes()[1] * tokens_per_step * steps / wall_s, 1)


REMEASURES_AFTER_COMPILE = 1
"""How many times the measured steps are run again when torch.compile compiled inside them (the
first window's figures and compile events stay in the line, ``remeasured_after_compile``)."""


def profiled_window(args: argparse.Namespace) -> bool:
    """Whether the measured steps run under a profiler or a memory recording, which are entered
    once, with the first window: such a run is not measured again."""
    return bool(getattr(args, "torch_profile", False) or getattr(args, "memory_snapshot", None) is not None)


MAX_SETTLING_STEPS = 3
"""The most warm-up steps added to --warmup until the plan has settled (`settled`)."""


def settled(pipe: Any, plans_run: list[Any]) -> bool:
    """Whether the next step runs a plan that has run before: no re-plan to come, and the plan in
    force built the last step's iteration. A re-plan takes effect with the next iteration, and
    that iteration compiles the graph variants its new stages need (on an H100, D's new first
    stage [0, 2] compiled for 6.5 s there): a step measured then times that compiling, not the
    plan."""
    return not replan_pending(pipe) and bool(plans_run) and plans_run[-1] == pipe.plan


def replan_pending(pipe: Any) -> bool:
    """Whether ``pipe`` is still to re-plan from measured times on the device."""
    planner = getattr(pipe, "_planner", None)
    if planner is None or planner.device_plan is None:  # no plan from device measurements to refine
        return False
    return bool(planner.replan_enabled and not planner.replanned)


def pinned_host_growth() -> dict[str, float]:
    """The pinned host allocator's totals so far: blocks it created (each a CUDA host allocation,
    slow for gigabyte blocks, where no cached block could be reused) and milliseconds spent in
    those allocations (all zero without CUDA)."""
    stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    return {
        "new_blocks": float(stats.get("num_host_alloc", 0)),
        "alloc_ms": float(stats.get("host_alloc_time.total", 0)) / 1000,
        "allocated_gib": float(stats.get("allocated_bytes.allocated", 0)) / (1 << 30),
    }


# torch.compile's outermost timers: a frame's compile (its forward's inductor build included) and
# a backward's, which inductor builds at its first call.
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process, on any thread."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(name, ())) for name in COMPILE_TIMERS))


def alloc_retries(indices: tuple[int, ...]) -> dict[str, int]:
    """Each device's count of allocations the caching allocator served only after freeing its
    cache (each one synchronizes the device): a budget tight enough to make them frequent costs
    speed."""
    return {f"cuda:{i}": int(torch.cuda.memory_stats(i).get("num_alloc_retries", 0)) for i in indices}


# --------------------------------------------------------------------- plain side (own process)


def processes() -> tuple[int, int]:
    """(this process's rank, how many processes average gradients): (0, 1) outside torchrun."""
    from roundpipe.optim.distributed import torchrun_environment

    if not torchrun_environment():
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def plain_in_subprocess(workload: Workload, args: argparse.Namespace) -> dict[str, Any] | str:
    # The plain loop is the whole model on the card as it is: a budget that is part of the workload
    # (C, long: "under 24 GiB") caps it too, a --budget given for roundpipe's plan does not.
    defined = WORKLOADS.get(workload.name)
    workload = replace(workload, budget=defined.budget if defined is not None else workload.budget)
    reason = plain_cannot_hold(workload)
    if reason is not None:
        return reason
    if processes()[1] > 1:
        return "not run under torchrun: the plain loop is one process (run it without torchrun)"
    job = {"workload": asdict(workload), "devices": args.devices, "warmup": args.warmup, "steps": args.steps}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--plain-child", json.dumps(job)]
    started = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    elapsed = {"elapsed_s": round(time.perf_counter() - started, 1)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return {**json.loads(lines[-1]), **elapsed}
    return {
        "error": f"the plain loop's process exited with status {done.returncode} and no result",
        **elapsed,
    }


def plain_child(job_text: str) -> None:
    job = json.loads(job_text)
    spec = job["workload"]
    workload = Workload(**{**spec, "shape": Shape(**spec["shape"])})
    print(
        json.dumps(run_plain(workload, job["devices"], job["warmup"], job["steps"]), default=str), flush=True
    )


# --------------------------------------------------------------------- output


def run_workload(workload: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    plain = plain_in_subprocess(workload, args) if args.plain else None
    lines = []
    for mode, model, build in _models(workload, args):
        started = time.perf_counter()
        # What an earlier configuration of this process left on the device (should be nothing).
        at_start = allocated_memory(cuda_indices(args.devices))
        try:
            if model is None:
                raise RuntimeError(f"building the {workload.name} model failed (traceback above)")
            with memory_history(f"{workload.name}-{mode}"):
                ours = run_roundpipe(workload, mode, args, model)
        except Exception as exc:  # one failed configuration must not lose the others' figures
            traceback.print_exc()
            ours = {
                "error": f"{type(exc).__name__}: {str(exc)[:800]}",
                "peak_gib": device_memory(cuda_indices(args.devices)),
            }
            del exc
        finally:
            del model
            _release_memory()
        ours["allocated_at_start_gib"] = at_start
        ours["elapsed_s"] = round(time.perf_counter() - started, 1)
        ours.update(build)
        lines.append(_line(workload, mode, args, ours, plain))
    return lines


@contextlib.contextmanager
def memory_history(name: str) -> Iterator[None]:
    """With ``ROUNDPIPE_BENCH_SNAPSHOT=DIR``: the allocator's history of this configuration and a
    task log, summarised at the peak into DIR/NAME.json (`gpu_memory_snapshot`), also when it
    fails: an out-of-memory the snapshot script does not reproduce is explained where it happens."""
    out = os.environ.get("ROUNDPIPE_BENCH_SNAPSHOT")
    if not out or not torch.cuda.is_available():
        yield
        return
    from gpu_memory_snapshot import TaskLog, live_at_peak

    log = TaskLog()
    torch.cuda.memory._record_memory_history(max_entries=300_000, context="alloc", stacks="python")
    try:
        yield
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        log.restore()
        summary = {
            "live_at_peak": live_at_peak(snapshot, log.uploads),
            "tasks_before_peak": log.around_peak(),
            "runtime_at_high": log.high_holdings,
        }
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(summary, indent=1, default=str))


def _models(workload: Workload, args: argparse.Namespace) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """Per mode, a fresh model and how it was built (seconds; the host's peak resident GiB while
    building, which for a base built a layer at a time must stay near its final bytes): built
    once (a 14B random init takes minutes on the host), then a copy for every mode but the last,
    which trains the original. A model built a layer at a time is built again per mode instead:
    two copies of a 32B base do not fit the host."""
    if workload.layerwise and len(args.modes) > 1:
        for mode in args.modes:
            (_, model, build), *_ = _models(workload, replace_modes(args, [mode]))
            yield mode, model, build
            del model
        return
    started = time.perf_counter()
    with RssSampler() as rss:
        try:
            dtype = model_dtype(args.model_dtype, bool(cuda_indices(args.devices)))
            original: Any = build_model(workload, dtype, init_on_gpu=True)
        except Exception:
            traceback.print_exc()
            original = None
    build = {"build_s": round(time.perf_counter() - started, 1), "build_rss_gib": rss.report()}
    progress(f"{workload.name}: model built in {build['build_s']} s")
    for k, mode in enumerate(args.modes):
        last = k == len(args.modes) - 1
        if last or original is None:
            yield mode, original, build
        else:
            started = time.perf_counter()
            model = copy.deepcopy(original)
            yield mode, model, {"build_s": round(time.perf_counter() - started, 1)}
            del model
    del original


def replace_modes(args: argparse.Namespace, modes: list[str]) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "modes": modes})


def _line(
    workload: Workload, mode: str, args: argparse.Namespace, ours: dict[str, Any], plain: Any
) -> dict[str, Any]:
    world = processes()[1]
    ratio = None
    if isinstance(plain, dict) and "tokens_per_s" in plain and "tokens_per_s" in ours:
        ratio = round(ours["tokens_per_s"] / plain["tokens_per_s"], 3)
    return {
        "bench": "gpu_throughput",
        "workload": workload.name,
        "mode": mode,
        "devices": args.devices,
        "device_names": device_names(args.devices),
        "shape": asdict(workload.shape),
        "params_m": round(workload.shape.param_count() / 1e6, 1),
        **{k: v for k, v in asdict(workload).items() if k not in ("name", "shape")},
        "processes": world,
        "tokens_per_step": world * workload.tokens,  # the global batch
        **budget_route(workload),
        "steps": args.steps,
        "warmup": args.warmup,
        "roundpipe": ours,
        "plain": plain,
        "ratio": ratio,
        "versions": versions(),
        "host": getattr(args, "host", None),  # this host's CPU and issue speed (bench/host_probe.py)
    }


def progress(message: str) -> None:
    """One line on stderr as a run goes (model built, pipe open, each step), so the log of a run
    killed at its time limit shows where the time went; the JSON line comes only at the end."""
    print(f"[gpu_throughput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(lines: list[dict[str, Any]]) -> str:
    def peak(side: Any) -> str:
        values = side.get("peak_gib", {}) if isinstance(side, dict) else {}
        return "/".join(f"{v:.1f}" for v in values.values()) or "-"

    def num(side: Any, key: str, fmt: str) -> str:
        return format(side[key], fmt) if isinstance(side, dict) and key in side else "-"

    rows = [
        (
            "workload",
            "mode",
            "ours tok/s",
            "ours GiB",
            "plain tok/s",
            "plain GiB",
            "ratio",
            "bubble",
            "exposed",
            "host-bound",
        )
    ]
    for line in lines:
        ours, plain = line["roundpipe"], line["plain"]
        rows.append(
            (
                line["workload"],
                line["mode"],
                num(ours, "tokens_per_s", ".0f") if "error" not in ours else "error",
                peak(ours),
                num(plain, "tokens_per_s", ".0f") if isinstance(plain, dict) else str(plain or "-")[:40],
                peak(plain),
                "-" if line["ratio"] is None else f"{line['ratio']:.2f}",
                num(ours, "bubble", ".1%"),
                num(ours, "exposed_transfer", ".1%"),
                num(ours, "host_bound", ".1%"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plain_child is not None:
        plain_child(args.plain_child)
        return
    rank, _ = processes()
    indices = cuda_indices(args.devices)
    if indices:  # models are built on the current device: this process's first GPU
        torch.cuda.set_device(indices[0])
    args.host = host_probe()  # before any workload: its threads and compile workers not yet there
    lines: list[dict[str, Any]] = []
    for workload in args.workloads:
        for line in run_workload(workload, args):
            lines.append(line)
            if rank != 0:  # one writer; every rank's figures are the same global step
                continue
            text = json.dumps(line, default=str)
            print(text, flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(text + "\n")
    if rank == 0:
        print(table(lines), flush=True)


if __name__ == "__main__":
    main()
