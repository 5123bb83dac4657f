"""What ran inside the measured steps, from torch.profiler: device time by kernel, host launches.

Why: the trace's breakdown (`roundpipe.sched.breakdown`) says how long each compute task held the
device and whether the host was still issuing it (host-bound), not what ran inside it. Two open
questions need the inside: whether a compute-bound workload spends its time in matrix products,
attention or glue (a 70B layer with a 4-bit base reached 41% of its matrix rate), and whether a
host-bound one is short of launches (many small kernels issued from Python) or waiting on a full
launch queue. The profiler sees every thread's operators and every kernel (CUPTI), so roundpipe's
lane threads are covered. One summary per run, divided by the measured steps; profiling slows the
steps, so their tokens/s are not the workload's.

    python bench/gpu_throughput.py --workload F --layers 4 --async --warmup 1 --steps 1 --torch-profile
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
TOP = 25
TOP_KERNELS = 60  # a layer's glue is dozens of kernels of 1-3% each: rank them apart from operators
# Device activity by kind, first match wins (a grouped product's CUTLASS name also says "Gemm"):
# the top rows name the largest kernels only, and a layer's many small ones (norms, routing,
# activations) add up below them. Operators are left out: their device time repeats their kernels'.
KERNEL_KINDS = (
    ("copy", ("Memcpy", "Memset")),
    ("grouped_product", ("GroupProblem", "grouped_gemm", "GroupedGemm")),
    ("product", ("nvjet", "gemm", "Gemm", "xmma", "cutlass", "cublas")),
    ("attention", ("sdpa", "fmha", "flash", "attention")),
    ("triton", ("triton_",)),
)


def _device_us(event: Any) -> float:
    # torch >= 2.4 names it for any device; earlier versions only for CUDA.
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def _host_us(event: Any) -> float:
    return float(event.self_cpu_time_total)


def kernel_kind(name: str) -> str:
    """The kind of one device activity by its name (`KERNEL_KINDS`), else ``"other"``."""
    for kind, marks in KERNEL_KINDS:
        if any(mark in name for mark in marks):
            return kind
    return "other"


def _on_device(event: Any) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and getattr(device_type, "name", str(device_type)) != "CPU"


def kernels_by_kind(rows: list[Any], per_step: int) -> dict[str, dict[str, float]]:
    """Per measured step, the device time and count of the kernels and copies of each kind."""
    kinds: dict[str, dict[str, float]] = {}
    for event in rows:
        if not _on_device(event):
            continue
        entry = kinds.setdefault(kernel_kind(event.key), {"ms_per_step": 0.0, "calls_per_step": 0.0})
        entry["ms_per_step"] += _device_us(event) / 1000 / per_step
        entry["calls_per_step"] += int(event.count) / per_step
    ranked = sorted(kinds.items(), key=lambda item: -item[1]["ms_per_step"])
    return {kind: {k: round(v, 3) for k, v in entry.items()} for kind, entry in ranked}


def summarize(events: Any, steps: int, on_device: bool) -> dict[str, Any]:
    """Per measured step: the operators and kernels that took the most self time (device time
    when a GPU ran them, host time otherwise; on a GPU also by host time, ``top_host``, and the
    kernels alone, ``top_kernels``), the device time of the kernels and copies (an operator's
    device time repeats its kernels'), by kind too, and the host's kernel launches."""
    rows = list(events)
    per_step = max(steps, 1)
    launches = [e for e in rows if e.key in LAUNCH_CALLS]
    top = sorted(rows, key=_device_us if on_device else _host_us, reverse=True)[:TOP]
    # On a GPU the host's own ranking says what a host-bound run's lanes spend their time on
    # (every thread's: the waiters' event synchronisations show here too, under their own names).
    top_host = sorted(rows, key=_host_us, reverse=True)[:TOP] if on_device else []
    kernels = sorted((e for e in rows if _on_device(e)), key=_device_us, reverse=True)[:TOP_KERNELS]
    return {
        "steps": steps,
        "ranked_by": "self device time" if on_device else "self host time",
        "device_ms_per_step": round(sum(_device_us(e) for e in rows if _on_device(e)) / 1000 / per_step, 3),
        "host_ms_per_step": round(sum(_host_us(e) for e in rows) / 1000 / per_step, 3),
        "kernel_launches_per_step": sum(int(e.count) for e in launches) // per_step,
        "launch_host_ms_per_step": round(sum(_host_us(e) for e in launches) / 1000 / per_step, 3),
        "kernels_by_kind": kernels_by_kind(rows, per_step),
        "top": [_row(e, per_step) for e in top],
        **({"top_host": [_row(e, per_step) for e in top_host]} if on_device else {}),
        **({"top_kernels": [_row(e, per_step) for e in kernels]} if on_device else {}),
    }


def _row(event: Any, per_step: int) -> dict[str, Any]:
    return {
        "name": event.key[:120],
        "calls_per_step": round(int(event.count) / per_step, 2),
        "self_device_ms_per_step": round(_device_us(event) / 1000 / per_step, 3),
        "self_host_ms_per_step": round(_host_us(event) / 1000 / per_step, 3),
    }


def _all_threads() -> Any:
    """Record every thread's operators (roundpipe's lanes run in their own threads), where this
    torch can; otherwise only the calling thread's (the kernels are all seen either way)."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


@contextmanager
def profiled(steps: int) -> Iterator[dict[str, Any]]:
    """Profile the block (``steps`` measured steps); the summary fills the yielded dict on exit."""
    on_device = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_device else [])]
    summary: dict[str, Any] = {}
    with profile(activities=activities, experimental_config=_all_threads()) as prof:
        yield summary
    summary.update(summarize(prof.key_averages(), steps, on_device))
