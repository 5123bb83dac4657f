"""Benchmark: what a thread of torch calls pays for the GIL beside threads that run Python.

Why: a CUDA pipe's compute lane issues kernels through torch calls, each of which lets go of the
GIL and takes it back, while the waiters, the copy lanes, the optimizer lane and the engine's loop
run Python in bursts. A thread that wants the GIL back waits until the holder drops it, up to the
interpreter's switch interval (5 ms by default); roundpipe holds it at 0.5 ms while a CUDA pipe is
open (`roundpipe.backends.cuda.GIL_SWITCH`). This isolates that mechanism on any machine: one
thread makes ``--calls`` tiny in-place torch calls while ``--busy`` threads alternate 2 ms of
Python with 1 ms of sleep; one JSON line per (busy threads, interval) with the microseconds a
call took. It measures the mechanism, not a pipe: the GPU figures are in docs/performance.md.

    python bench/gil_switch.py [--busy 0 1 2 3] [--calls 20000]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch


def per_call_us(interval_s: float, busy: int, calls: int) -> float:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    x = torch.zeros(8)
    stop = threading.Event()

    def python_bursts() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            while time.perf_counter() - start < 0.002:
                pass
            time.sleep(0.001)

    threads = [threading.Thread(target=python_bursts) for _ in range(busy)]
    try:
        for thread in threads:
            thread.start()
        start = time.perf_counter()
        for _ in range(calls):
            x.add_(1.0)
        return (time.perf_counter() - start) / calls * 1e6
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    for busy in args.busy:
        for interval_s in (0.005, 0.0005):
            us = per_call_us(interval_s, busy, args.calls)
            line = {"bench": "gil_switch", "busy_threads": busy, "interval_ms": interval_s * 1e3}
            print(json.dumps(line | {"us_per_call": round(us, 1)}), flush=True)


if __name__ == "__main__":
    main()
