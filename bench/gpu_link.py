"""The host link's figures of a GPU run: bytes moved, achieved rate, busy share, and the link bound.

Why apart: for a model larger than the card every iteration moves every weight at least twice,
so the link, not the GPU, may set the pace; a benchmark line must say which one did. The bytes and
times come from the trace (each transfer task records the bytes it moved and, on CUDA, its device
interval), the link's own rate from a pinned host-to-device copy timed in the same process. A
task-level view, not a counter: the trace is what the schedule did.

It reads tasks through their public fields only and must never schedule or move anything itself,
except the probe's one buffer, which it frees.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from roundpipe.planning.measured import measured_link_gbps
from roundpipe.sched.trace import Trace

H2D_KINDS = frozenset({"param_up", "act_up", "grad_up"})
D2H_KINDS = frozenset({"act_down", "grad_down"})
COMPUTE_KINDS = frozenset({"compute", "recompute"})


def h2d_probe_gbps(index: int | None, nbytes: int = 1 << 30, repeats: int = 4) -> float | None:
    """Host-to-device GB/s of one ``nbytes`` copy from pinned memory, the best of ``repeats``
    (after one untimed copy); None without a CUDA device."""
    if index is None or not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    stream = torch.cuda.Stream(device=index)
    best = float("inf")
    with torch.cuda.stream(stream):
        for attempt in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            device.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            if attempt > 0:
                best = min(best, start.elapsed_time(end))
    del host, device
    torch.cuda.empty_cache()
    return round(nbytes / (best * 1e6), 2)


def _union_ms(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= max(a, end):
            continue
        total += b - max(a, end)
        end = b
    return total


def link_figures(
    trace: Iterable[Any],
    iterations: Iterable[int],
    window_ms: tuple[float, float],
    model_upload_bytes: int | None,
    probe_gbps: float | None,
    tokens_per_step: int,
    tokens_per_s: float,
) -> dict[str, Any]:
    """Per measured iteration: bytes moved each way; the achieved host-to-device rate (bytes over
    the time some upload was moving, per device); the share of the window the link was busy
    uploading and the share the GPU computed (mean over devices); and the link bound: every
    parameter byte uploaded twice per iteration (forward, and backward with its recompute) at
    the probed rate, as tokens/s, with the achieved tokens/s as a fraction of it."""
    wanted = set(iterations)
    tasks = [t for t in trace if t.iteration in wanted]
    n = max(len(wanted), 1)
    lo, hi = window_ms
    span = max(hi - lo, 1e-9)
    bytes_by_kind: dict[str, int] = {}
    for t in tasks:
        bytes_by_kind[t.kind] = bytes_by_kind.get(t.kind, 0) + int(t.nbytes)
    devices = sorted({t.device for t in tasks if t.kind in COMPUTE_KINDS})
    busy, moving, computing = [], 0.0, []
    for d in devices:
        ups = [(t.start_t, t.end_t) for t in tasks if t.device == d and t.kind in H2D_KINDS]
        busy.append(_union_ms(ups, lo, hi) / span)
        moving += _union_ms(ups, float("-inf"), float("inf"))
        runs = [(t.start_t, t.end_t) for t in tasks if t.device == d and t.kind in COMPUTE_KINDS]
        computing.append(_union_ms(runs, lo, hi) / span)
    h2d = sum(b for k, b in bytes_by_kind.items() if k in H2D_KINDS)
    out: dict[str, Any] = {
        "bytes_per_iteration": {k: v // n for k, v in sorted(bytes_by_kind.items()) if v},
        "h2d_bytes_per_iteration": h2d // n,
        "param_up_bytes_per_iteration": bytes_by_kind.get("param_up", 0) // n,
        "d2h_bytes_per_iteration": sum(b for k, b in bytes_by_kind.items() if k in D2H_KINDS) // n,
        "h2d_gbps_achieved": round(h2d / (moving * 1e6), 2) if moving > 0 else None,
        "link_busy": round(sum(busy) / len(busy), 4) if busy else None,
        "compute_fraction": round(sum(computing) / len(computing), 4) if computing else None,
        "h2d_gbps_probe": probe_gbps,
        "model_upload_bytes": model_upload_bytes,
    }
    if model_upload_bytes:
        out["param_passes_per_iteration"] = round(out["param_up_bytes_per_iteration"] / model_upload_bytes, 3)
    if model_upload_bytes and probe_gbps:
        bound_s = 2 * model_upload_bytes / (probe_gbps * 1e9)
        out["link_bound_step_s"] = round(bound_s, 4)
        out["link_bound_tokens_per_s"] = round(tokens_per_step / bound_s, 1)
        out["of_link_bound"] = round(tokens_per_s * bound_s / tokens_per_step, 4)
    return out


def param_up_rates(trace: Iterable[Any]) -> dict[str, list[float]]:
    """Per iteration of the whole trace, the weight uploads' GB/s three ways: the planner's
    reading (`measured_link_gbps`: the rate of their bytes' median), their bytes over the sum of
    their spans, and over the union of their spans per device (what moved, as
    ``h2d_gbps_achieved`` counts). The sum apart from the union, the spans overlap; the sum far
    below the median in one iteration alone, a few of its uploads stalled there (the re-plan
    reads the second iteration)."""
    by_iteration: dict[int, list[Any]] = {}
    for t in trace:
        if t.kind == "param_up" and t.end_t > t.start_t:
            by_iteration.setdefault(t.iteration, []).append(t)
    rates: dict[str, list[float]] = {}
    for it, tasks in sorted(by_iteration.items()):
        planner = measured_link_gbps(Trace(tasks), since_iteration=it) or 0.0  # its own reading
        moved = sum(int(t.nbytes) for t in tasks)
        summed = sum(t.end_t - t.start_t for t in tasks)
        union = sum(
            _union_ms([(t.start_t, t.end_t) for t in tasks if t.device == d], float("-inf"), float("inf"))
            for d in {t.device for t in tasks}
        )
        rates[str(it)] = [
            round(planner, 2),
            round(moved / (summed * 1e6), 2),
            round(moved / (union * 1e6), 2),
        ]
    return rates


def model_upload_bytes(pipe: Any) -> int | None:
    """Bytes one pass over every layer uploads: the scheduler's per-layer parameter bytes."""
    spec = getattr(pipe, "_spec", None)
    values = getattr(spec, "param_bytes", None)
    return int(sum(values)) if values is not None else None
