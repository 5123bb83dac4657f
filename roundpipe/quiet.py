"""Other libraries' progress bars, warnings and log lines, kept out of what roundpipe shows.

Why: ``roundpipe train`` draws one progress display, and a transformers ``Loading weights`` or
``Writing model shards`` bar, a peft deprecation or a bitsandbytes kernel message in the middle of
it tells the user nothing they can act on. Two tools, narrow on purpose:

- `quiet_libraries`, a context manager around the calls roundpipe itself makes into those libraries
  (loading a model, saving one): their progress bars off and their log level at errors while it
  runs, the previous settings restored after, deprecation warnings raised inside it hidden;
- `install_filters`, run when roundpipe is imported: hides the few known messages, each named in
  `KNOWN_NOISE`, that the libraries print on their own import or from their calls to each other,
  none of which the user can act on.

This module must never hide an error, a warning of roundpipe's own, or anything outside those
calls and messages; it imports no third-party library at import time.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

# (logger name, or "warnings"; the start of the message): printed by a library about another one.
KNOWN_NOISE: tuple[tuple[str, str], ...] = (
    # peft asks transformers a question it has renamed; peft's to change, not the user's.
    ("warnings", "`is_gradient_checkpointing` is deprecated"),
    # bitsandbytes (imported by peft) looks for an optional CPU kernel on the Hub at import.
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)
LIBRARY_LOGGERS = ("transformers", "peft", "huggingface_hub", "bitsandbytes", "accelerate")


class _DropPrefix(logging.Filter):
    """Drops the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


_installed = False


def install_filters() -> None:
    """Hide `KNOWN_NOISE` for the rest of the process (idempotent). A logger is created here when
    its library is not imported yet: the library's own ``getLogger(__name__)`` then returns it,
    filter included."""
    global _installed
    if _installed:
        return
    _installed = True
    for source, prefix in KNOWN_NOISE:
        if source == "warnings":
            warnings.filterwarnings("ignore", message=re.escape(prefix))
        else:
            logging.getLogger(source).addFilter(_DropPrefix(prefix))


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Inside: transformers' and huggingface_hub's progress bars off, the libraries' loggers at
    ERROR, deprecation warnings hidden; everything as it was after."""
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        levels = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        stack.callback(_restore_levels, levels)
        stack.enter_context(_bars_off())
        yield


def _restore_levels(levels: dict[str, int]) -> None:
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@contextmanager
def _bars_off() -> Iterator[None]:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None  # type: ignore[assignment]
    try:
        from huggingface_hub import utils as hub_utils
    except ImportError:
        hub_utils = None  # type: ignore[assignment]
    bars_on = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    hub_on = hub_utils is not None and not hub_utils.are_progress_bars_disabled()
    if bars_on:
        hf_logging.disable_progress_bar()
    if hub_on:
        hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()
        if hub_on:
            hub_utils.enable_progress_bars()


__all__ = ["KNOWN_NOISE", "install_filters", "quiet_libraries"]
