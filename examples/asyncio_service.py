"""roundpipe inside an asyncio service: train in the background, answer requests meanwhile.

One event loop runs three things at once:

- a **trainer** task that awaits ``pipe.aforward_backward(...)`` and ``pipe.astep()``; the pipeline
  runs on roundpipe's own engine thread and CPU workers, so these awaits never block the loop;
- a **status server** (``asyncio.start_server`` on 127.0.0.1, port 0 by default = any free port):
  every line a client sends is answered with one JSON line
  ``{"step": ..., "loss": ..., "tokens_per_s": ..., "state": "starting" | "training" | "done"}``;
- a **client** and a **heartbeat** that show the loop never stalls: the client asks for the status
  every few milliseconds while training runs, the heartbeat measures the longest gap between
  two wake-ups of the loop.

The run is bounded (``--steps``) and stops by itself: when training is done the server closes.
While it runs you can also ask from another terminal, e.g. ``nc 127.0.0.1 PORT`` and press Enter.

    python examples/asyncio_service.py --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import roundpipe
from roundpipe.data.text import CORPUS_PATH, token_batches
from roundpipe.model import build_model

HOST = "127.0.0.1"


@dataclass
class Status:
    """What the service reports; written by the trainer, read by the request handler."""

    step: int = 0
    loss: float | None = None
    tokens: int = 0
    state: str = "starting"
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None

    def to_json(self) -> str:
        elapsed = (self.finished or time.perf_counter()) - self.started
        return json.dumps(
            {
                "step": self.step,
                "loss": self.loss,
                "tokens_per_s": self.tokens / elapsed if elapsed > 0 else 0.0,
                "state": self.state,
            }
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps, then stop (default 20)")
    parser.add_argument(
        "--port", type=int, default=0, help="status port on 127.0.0.1 (default 0: any free port)"
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    parser.add_argument(
        "--poll-ms", type=float, default=20.0, help="how often the built-in client asks (default 20)"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser.parse_args(argv)


async def handle_client(status: Status, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request line with the current status as one JSON line."""
    try:
        while line := await reader.readline():
            if line.strip():
                writer.write(status.to_json().encode() + b"\n")
                await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def make_pipe(args: argparse.Namespace) -> roundpipe.RoundPipe:
    model = build_model("qwen3-tiny", seed=0)
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=args.microbatches, async_optimizer=True)
    return roundpipe.RoundPipe(
        model, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), config=config
    )


async def train(args: argparse.Namespace, status: Status) -> None:
    # Building the model and the pipe is ordinary blocking work: do it off the loop.
    pipe = await asyncio.to_thread(make_pipe, args)
    batches = token_batches(CORPUS_PATH, seq_len=args.seq_len, batch_size=args.batch_size, seed=0)
    try:
        status.state, status.started = "training", time.perf_counter()
        for step in range(args.steps):
            batch = next(batches)
            loss = await pipe.aforward_backward(batch, None, None)
            await pipe.astep()
            status.step, status.loss = step + 1, loss
            status.tokens += batch["input_ids"].numel()
            if not args.quiet:
                print(f"trainer: step {step + 1:3d}  loss {loss:.4f}")
        await pipe.asynchronize()
    finally:
        status.state = "done"
        status.finished = time.perf_counter()
        # close() waits for the engine thread; run it off the loop so the service keeps answering.
        await asyncio.to_thread(pipe.close)


async def poll(port: int, period_s: float, done: asyncio.Event) -> list[tuple[float, dict[str, Any]]]:
    """A client on the same loop: ask for the status until training is done.
    Returns (round-trip seconds, reply) per request."""
    reader, writer = await asyncio.open_connection(HOST, port)
    replies: list[tuple[float, dict[str, Any]]] = []
    try:
        while not done.is_set():
            sent = time.perf_counter()
            writer.write(b"status\n")
            await writer.drain()
            reply = json.loads(await reader.readline())
            replies.append((time.perf_counter() - sent, reply))
            await asyncio.sleep(period_s)
    finally:
        writer.close()
        await writer.wait_closed()
    return replies


async def heartbeat(period_s: float, done: asyncio.Event) -> list[tuple[float, float]]:
    """How late the loop woke up each time, beyond the sleep asked for: (time, seconds late)."""
    delays = []
    last = time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(period_s)
        now = time.perf_counter()
        delays.append((now, now - last - period_s))
        last = now
    return delays


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    status = Status()
    server = await asyncio.start_server(lambda r, w: handle_client(status, r, w), HOST, args.port)
    port = server.sockets[0].getsockname()[1]
    if not args.quiet:
        print(f"status server on {HOST}:{port} (send any line, get a JSON line back)")
    done = asyncio.Event()
    async with server:
        client = asyncio.create_task(poll(port, args.poll_ms / 1e3, done))
        beat = asyncio.create_task(heartbeat(0.005, done))
        started = time.perf_counter()
        try:
            await train(args, status)
        finally:
            done.set()
            elapsed = time.perf_counter() - started
            replies = await client
            delays = await beat
        # One last request after training: the final status.
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(b"status\n")
        final = json.loads(await reader.readline())
        writer.close()
        await writer.wait_closed()

    during = [(rt, reply) for rt, reply in replies if reply["state"] == "training"]
    steps_seen = sorted({reply["step"] for _, reply in during})
    round_trips = [rt for rt, _ in during]
    # Only while training: building the model in a thread competes with the loop for the GIL.
    training_delays = [d for t, d in delays if status.started <= t <= (status.finished or t)]
    result = {
        "port": port,
        "requests_answered": len(replies),
        "answered_while_training": len(during),
        "steps_seen_while_training": steps_seen,
        "max_round_trip_ms": 1e3 * max(round_trips) if round_trips else None,
        "max_loop_delay_ms": 1e3 * max(training_delays, default=0.0),
        "loop_wakeups_while_training": len(training_delays),
        "train_seconds": elapsed,
        "final": final,
    }
    print(
        f"trained {final['step']} steps in {elapsed:.1f} s (final loss {final['loss']:.4f}, "
        f"{final['tokens_per_s']:.0f} tokens/s); answered {len(during)} status requests while training "
        f"(saw steps {steps_seen[0] if steps_seen else '-'}..{steps_seen[-1] if steps_seen else '-'}), "
        f"slowest reply {result['max_round_trip_ms'] or 0:.1f} ms, loop woke up at most "
        f"{result['max_loop_delay_ms']:.1f} ms late"
    )
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    main(sys.argv[1:])
