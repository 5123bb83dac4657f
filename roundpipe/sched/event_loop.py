"""Where roundpipe's event loop comes from, and how synchronous callers reach it.

uvloop is faster than the default loop, but roundpipe must also work where it is missing
(Windows) and where the caller already runs a loop (a notebook, a service). This module is the
one place that decides: `new_event_loop()` prefers uvloop, and `run_sync(coro)` runs a coroutine
to completion from synchronous code, on a private thread when the calling thread already has a
running loop (so it never blocks or re-enters the caller's loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platform without uvloop
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result, from any synchronous context."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = new_event_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(run_sync(coro))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="roundpipe-run-sync", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
