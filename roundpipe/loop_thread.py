"""The engine's private event loop on its own thread, and how callers of any kind reach it.

Why a private loop on a background thread: the engine is asyncio, but users call
`RoundPipe.forward_backward` from scripts, notebooks whose loop is already running, other
threads, or their own services. Owning the loop means the sync API works anywhere (it blocks only
the caller's thread) and the async API awaits the engine without ever blocking the caller's loop.
`roundpipe.sched.event_loop` decides which loop implementation to use; this module owns the thread
that runs it.

It must never run engine work on the caller's loop, and never let a synchronous call from its
own thread wait on itself (that would deadlock).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from roundpipe.sched.event_loop import new_event_loop

T = TypeVar("T")


class LoopRunner:
    """An event loop running forever on a daemon thread until `shutdown()`."""

    def __init__(self, name: str = "roundpipe-loop") -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block the calling thread until it returns."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("RoundPipe's synchronous API cannot be called from its own engine thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and await it from the caller's own loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop and wait for its thread. Idempotent."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=timeout_s)

    def close(self) -> None:
        """Close the stopped loop. Kept apart from `stop()` so workers that report to the loop
        can be closed in between. Idempotent; a loop still running (its thread did not stop in
        time) is left open rather than closed under it."""
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def shutdown(runner: LoopRunner, backend: Any, release: Callable[[], None] | None = None) -> None:
    """Stop the loop before the workers that report to it (a backend's ``close()``), and close
    the loop only after them; then ``release`` (lifts a device memory cap)."""
    runner.stop()
    backend.close()
    runner.close()
    if release is not None:
        release()
