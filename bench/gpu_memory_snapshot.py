"""Where a GPU run's memory goes: the allocator's history around roundpipe's peak, with stacks.

Why: the planner predicts each device's peak from per-layer measurements; when a run's measured
peak differs, the allocator's own record (every allocation and free, with the Python stack that
made it) says which tensors were alive at the peak and who made them. This runs a few steps of a
Qwen3-shaped model with the history recorded and writes a gzipped snapshot plus a JSON summary:
the live bytes at the peak grouped by the innermost roundpipe frame that allocated them.

    python bench/gpu_memory_snapshot.py --layers 8 --seq 2048 --batch 32 --microbatches 4 --budget 12GiB --out DIR

Any workload of bench/gpu_throughput.py, with its own configuration, over its measured steps
(`recorded`; the summary alone, no snapshot file):

    python bench/gpu_throughput.py --workload F --async --loss-lag 1 --warmup 2 --steps 1 --memory-snapshot DIR
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parent))

from gpu_throughput_run import Shape, Workload, adamw, build_model, make_batch

import roundpipe


def _frame_of(frames: list[dict]) -> str:
    """The innermost frame inside roundpipe (else the innermost Python frame)."""
    for frame in frames:
        name = frame.get("filename", "")
        if "roundpipe/" in name:
            return f"{name.split('roundpipe/')[-1]}:{frame.get('line')} {frame.get('name')}"
    for frame in frames:
        if frame.get("filename", "").endswith(".py"):
            return f"{frame['filename'].split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "?"


def _task_of(frames: list[dict]) -> str:
    """The runtime's handler (the task kind) that made an allocation, else the outermost roundpipe frame."""
    names = [f for f in frames if "roundpipe/" in f.get("filename", "")]
    for frame in names:
        if frame.get("filename", "").endswith("backends/runtime.py") and frame.get("name") not in (
            "run",
            "_run",
        ):
            return f"runtime.{frame.get('name')}"
    return names[-1].get("name", "?") if names else "?"


def _code_of(frames: list[dict]) -> str:
    """The innermost Python frame outside torch (the model's or roundpipe's line)."""
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name:
            return (
                f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.get('line')} {frame.get('name')}"
            )
    return _frame_of(frames)


def allocations_so_far() -> int:
    """The allocator's count of allocations on device 0 since the process began: the ordinal of
    the latest one, which ties a host-side record to the history's allocations."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats(0).get("allocation.all.allocated", 0))


class TaskLog:
    """Which task issued what: every `Runtime.run` and `Runtime.finish` with the device's allocated
    bytes before and after (issue order on the host is stream order on the device), and which
    task's upload made each uploaded tensor (by address, with the allocator's allocation count
    then: an address serves many blocks in turn), to name the uploads alive at the peak."""

    def __init__(self) -> None:
        import threading

        import roundpipe.backends.runtime as runtime_module
        from roundpipe.backends.holdings import device_holdings

        self.events: list[tuple[str, str, str, int, int]] = []
        self.uploads: dict[int, list[tuple[int, str]]] = {}
        self.first_allocation = 0  # the count when the history began (`recorded`)
        # The runtime's own account (`device_holdings`) each time a task left the device at a new
        # high: whose weights, activations and recomputes were alive, by run, at the highest point.
        self.high = 0
        self.high_holdings: dict[str, object] = {}
        self._local = threading.local()
        runtime_cls = runtime_module.Runtime
        original_run, original_finish = runtime_cls.run, runtime_cls.finish
        original_to_device = runtime_module.to_device
        log = self

        def run(runtime, task):  # type: ignore[no-untyped-def]
            before = torch.cuda.memory_allocated(0)
            log._local.task = f"{task.kind} {task.key}"
            try:
                return original_run(runtime, task)
            finally:
                after = torch.cuda.memory_allocated(0)
                log.events.append((threading.current_thread().name, task.kind, str(task.key), before, after))
                if after > log.high:
                    log.high = after
                    held = device_holdings(runtime, torch.device("cuda", 0))
                    log.high_holdings = {
                        "after": f"{task.kind} {task.key}",
                        "allocated_gib": round(after / 2**30, 3),
                        "unnamed_gib": round((after - sum(held.values())) / 2**30, 3),
                        "held_mib": {k: round(v / 2**20, 1) for k, v in held.items()},
                    }

        def finish(runtime, task, *, failed=False):  # type: ignore[no-untyped-def]
            before = torch.cuda.memory_allocated(0)
            original_finish(runtime, task, failed=failed)
            log.events.append(("waiter", "finish", str(task.key), before, torch.cuda.memory_allocated(0)))

        def to_device(obj, device, non_blocking=False):  # type: ignore[no-untyped-def]
            out = original_to_device(obj, device, non_blocking)
            # One count for the call: every tensor it made was allocated by now (and none freed).
            seen, label = allocations_so_far(), getattr(log._local, "task", "?")
            stack = [out]
            while stack:
                item = stack.pop()
                if isinstance(item, torch.Tensor):
                    self.uploads.setdefault(item.data_ptr(), []).append((seen, label))
                elif isinstance(item, dict):
                    stack.extend(item.values())
                elif isinstance(item, list | tuple):
                    stack.extend(item)
            return out

        runtime_cls.run, runtime_cls.finish = run, finish  # type: ignore[method-assign]
        runtime_module.to_device = to_device  # type: ignore[assignment]
        self._originals = (runtime_module, original_run, original_finish, original_to_device)

    def restore(self) -> None:
        module, run, finish, to_device = self._originals
        module.Runtime.run, module.Runtime.finish = run, finish
        module.to_device = to_device  # type: ignore[attr-defined]

    def around_peak(self, count: int = 120) -> list[str]:
        """The task events before the highest allocated figure the log saw."""
        if not self.events:
            return []
        top = max(range(len(self.events)), key=lambda i: self.events[i][4])
        rows = self.events[max(0, top - count) : top + 10]
        return [
            f"{t[0][:12]:12} {t[1]:10} {t[2]:40} {t[3] / 2**30:6.2f} -> {t[4] / 2**30:6.2f}" for t in rows
        ]


def live_at_peak(
    snapshot: dict,
    uploads: dict[int, list[tuple[int, str]]] | None = None,
    first_allocation: int = 0,
    last_allocation: int | None = None,
) -> dict[str, object]:
    """Replay the device trace; at the peak of live bytes, group the live blocks by the task kind
    that made them, by roundpipe frame, and by the innermost line outside torch. ``uploads``: per
    address, (allocation count, task) for each uploaded tensor found there; the history's k-th
    allocation is count ``first_allocation + k``, so a live block is named by the first upload
    recorded at its address from its own allocation on and before the next one there (a history
    cut short by its entry limit, its allocations fewer than ``last_allocation`` says, names none)."""
    live: dict[int, tuple[int, list[dict], int]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list[dict], int]] = {}
    allocated_at: dict[int, list[int]] = {}  # per address, its allocations' counts
    count = first_allocation
    for device_trace in snapshot.get("device_traces", []):
        for event in device_trace:
            action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
            if action == "alloc":
                count += 1
                allocated_at.setdefault(addr, []).append(count)
                live[addr] = (size, event.get("frames", []), count)
                total += size
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif action in ("free_requested", "free") and addr in live:
                total -= live.pop(addr)[0]

    def grouped(key) -> dict[str, float]:  # type: ignore[no-untyped-def]
        groups: dict[str, int] = {}
        for size, frames, _made in at_peak.values():
            k = key(frames)
            groups[k] = groups.get(k, 0) + size
        top = sorted(groups.items(), key=lambda kv: -kv[1])[:30]
        return {k: round(v / 2**30, 3) for k, v in top}

    by_upload: dict[str, int] = {}
    complete = last_allocation is None or count == last_allocation
    upload_log = uploads if uploads and complete else {}
    for addr, (size, _frames, made) in at_peak.items():
        later = [c for c in allocated_at[addr] if c > made]
        until = later[0] if later else float("inf")
        named = [label for seen, label in upload_log.get(addr, ()) if made <= seen < until]
        if named:
            by_upload[named[0]] = by_upload.get(named[0], 0) + size
    return {
        "peak_live_gib": peak / 2**30,
        "uploads_alive_mib": {k: round(v / 2**20, 1) for k, v in sorted(by_upload.items())},
        "by_task_gib": grouped(_task_of),
        "by_frame_gib": grouped(_frame_of),
        "by_code_gib": grouped(_code_of),
    }


@contextmanager
def recorded(
    out: Path,
    max_entries: int = 1_000_000,
    facts: dict[str, Any] | None = None,
    snapshot_file: bool = False,
) -> Iterator[dict[str, Any]]:
    """Record the allocator's history and the runtime's tasks over the block; on exit write
    ``out/memory_summary.json`` (``facts``, as the block left them, then the live bytes at the
    block's peak by task, frame and line, the tasks before the peak, the runtime's own holdings at
    its highest point), with ``snapshot_file`` the history too, and fill the yielded dict with the
    summary's short form. Blocks allocated before the block are not in the replayed peak (the
    runtime's holdings and the allocator's figures are absolute)."""
    log = TaskLog()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="alloc", stacks="python")
    log.first_allocation = allocations_so_far()
    short: dict[str, Any] = {}
    try:
        yield short
    finally:
        last_allocation = allocations_so_far()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        log.restore()
        live = live_at_peak(snapshot, log.uploads, log.first_allocation, last_allocation)
        summary = dict(facts or {}) | {
            "measured_peak_gib": torch.cuda.max_memory_allocated(0) / 2**30,
            "live_at_peak": live,
            "tasks_before_peak": log.around_peak(),
            "runtime_at_high": log.high_holdings,
        }
        out.mkdir(parents=True, exist_ok=True)
        if snapshot_file:
            with gzip.open(out / "snapshot.pickle.gz", "wb") as f:
                pickle.dump(snapshot, f)
        (out / "memory_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        short.update(
            summary=str(out / "memory_summary.json"),
            peak_live_gib=round(float(live["peak_live_gib"]), 3),  # type: ignore[arg-type]
            by_task_gib=live["by_task_gib"],
            runtime_at_high=log.high_holdings,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--budget", default="12GiB")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    shape = Shape(args.layers, 2048, 6144, 16, 8, 128, 151936, True)
    workload = Workload("probe", shape, args.batch, args.seq, args.microbatches, budget=args.budget)
    model = build_model(workload, torch.bfloat16, init_on_gpu=True)
    batch = make_batch(workload)
    config = roundpipe.RunConfig(
        devices="cuda:0",
        num_microbatches=args.microbatches,
        precision="bf16",
        async_optimizer=not args.sync,
        memory_budget=args.budget,
        compile={"auto": "auto", "on": True, "off": False}[args.compile],
    )
    summary: dict[str, object] = {"args": vars(args) | {"out": str(args.out)}}
    pipe = None
    with recorded(args.out, max_entries=200_000, facts=summary, snapshot_file=True) as short:
        try:
            with roundpipe.RoundPipe(model, optimizer=adamw([]), config=config) as pipe:
                for _ in range(args.steps):
                    pipe.forward_backward(batch)
                    pipe.step()
                pipe.synchronize()
        except Exception as exc:  # the snapshot is the point, also (above all) after an out-of-memory
            summary["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        if pipe is not None:
            prediction = pipe.memory_prediction
            summary["predicted_peak_gib"] = None if prediction is None else prediction.peak_bytes / 2**30
            summary["prediction"] = None if prediction is None else prediction.to_dict()
            summary["plan"] = str(pipe.plan)
            device_plan = getattr(getattr(pipe, "_planner", None), "device_plan", None)
            memory = getattr(device_plan, "memory", None)
            summary["layer_memory"] = None if memory is None else memory.to_dict()
    print((args.out / "memory_summary.json").read_text())
    print(json.dumps(short, default=str))


if __name__ == "__main__":
    main()
