"""Which layers run through `torch.compile`, decided once per layer copy.

Why: on a GPU an eager decoder layer spends about as long in memory-bound glue (norms, rotary
tables, SwiGLU, residual adds, dtype casts) as in its matrix products. On an H200, one Qwen3-1.7B
layer at 16K tokens took 16.0 ms for forward and backward eagerly and 9.8 ms compiled; the chunked
LM-head loss spent more time in its fp32 elementwise pass than in its three matrix products.
Compiling removes that glue, so on CUDA it is on by default (``RunConfig.compile="auto"``).

How: a layer may say how it wants to be compiled by defining ``roundpipe_compile(compiler)``
(the transformers presets do: a decoder block compiles its inner layer, the head switches its loss
to the fused kernel, the embedding stays eager because it validates inputs and builds masks with
Python logic). Layers without the hook are compiled whole only when compiling was asked for
explicitly (``compile=True``); "auto" leaves a user's own layers as they are.

On CUDA the compiled code launches its kernels from a C++ wrapper (inductor's ``cpp_wrapper``)
instead of generated Python. With 4,096-token microbatches (workload A of docs/performance.md) a
Qwen3-1.7B layer's kernels are short enough that the GPU ran them as fast as the host issued them
for 73-82% of the step (`roundpipe.sched.breakdown`'s ``host_bound``); a stack sampler put the
compute lane's time in the generated Python launch code. With the C++ wrapper the same run went
from 19.7-24.2K to 29.5K tokens/s and 16% host-bound, for about a minute more of compiling on the
first run (the compiled code is cached on disk for the next). Setting ``TORCHINDUCTOR_CPP_WRAPPER``
in the environment (to 0 or 1) leaves the choice to inductor's own setting.

Mixture-of-experts layers launch from the C++ wrapper too, their grouped matrix products
routed through roundpipe's own operator (`experts.dispatch_products`): torch 2.11's CUDA shim
header declares no ``aoti_torch_cuda__grouped_mm``, so a C++ wrapper calling torch's product does
not build, while it calls a registered operator through the dispatcher. On one H100 with the
coarse one-device stages the Qwen3-30B-A3B benchmark at 16 x 4,096 tokens (workload D16) ran
12,055 tokens/s and 4.9% host-bound against 11,447 and 35.2% with the Python wrapper; D ran 7,014
tokens/s, 4.1% host-bound, at 94.6% of its link bound (docs/performance.md).
``TORCHINDUCTOR_CPP_WRAPPER=0`` in the environment keeps the Python wrapper.

The wrapper is switched on through inductor's process-wide setting while a CUDA pipe that
compiles is open (`CPP_WRAPPER`), not as a per-compile option: inductor compiles a graph's
backward lazily, at its first backward call, and torch 2.11 (the lent H200s' version) applies a
per-compile ``cpp_wrapper`` to the forward only, so every compiled decoder layer's first
backward failed there with "CudaKernelParamCache not populated" (also with
``triton.store_cubin`` set). The process-wide setting is what ``TORCHINDUCTOR_CPP_WRAPPER=1``
sets, and the figures above were measured with it. torch >= 2.12 keeps a written setting per
thread, while the lanes compile on threads of their own and autograd compiles a backward on its
device threads: `write_everywhere` makes this one and the recompile limit reach every thread.

Compiled code is shared: replicas are structural copies whose parameter slots are rebound for
every call, and `torch.compile` treats module parameters as graph inputs, so every layer of one
class runs the same graph (measured: four copies rebound for eight calls built two graphs, one
without grad and one with). This module only prepares modules; it never runs them.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextvars import Context, ContextVar
from typing import Any, Literal

import torch
from torch import nn

from roundpipe.backends.held_setting import HeldSetting
from roundpipe.errors import ConfigError
from roundpipe.model.chunked_mlp import LongRowSlicing, attach_slicing
from roundpipe.model.experts import dispatch_products

CompileSetting = bool | Literal["auto"]
# torch.compile's options for every Compiler made without its own (tests set backend="eager").
DEFAULT_OPTIONS: dict[str, Any] = {}


class Compiler:
    """What a layer's ``roundpipe_compile`` hook receives: compiles a module in place, or a
    function (one compiled function per original, shared by every layer that asks)."""

    def __init__(self, **options: Any) -> None:
        self.options = options or dict(DEFAULT_OPTIONS)
        self._functions: dict[Callable[..., Any], Callable[..., Any]] = {}

    def module(self, module: nn.Module) -> None:
        module.compile(**self.options)

    def function(self, fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        compiled = self._functions.get(fn)
        if compiled is None:
            compiled = self._functions[fn] = torch.compile(fn, **(self.options | options))
        return compiled


def default_options(device_type: str) -> dict[str, Any]:
    """torch.compile's options for the layers of a run on ``device_type``: `DEFAULT_OPTIONS`
    (tests choose a backend there), else torch.compile's defaults."""
    del device_type  # one answer for every device today; the C++ wrapper is `CPP_WRAPPER`'s
    return dict(DEFAULT_OPTIONS)


def wants_cpp_wrapper(device_type: str) -> bool:
    """Whether compiled layers on ``device_type`` launch from the C++ wrapper (see the module
    docstring): on CUDA, unless the environment chose for inductor, the tests chose options, or
    no C++ compiler is installed to build it."""
    return (
        device_type == "cuda"
        and not DEFAULT_OPTIONS
        and "TORCHINDUCTOR_CPP_WRAPPER" not in os.environ
        and _cpp_compiler()
    )


def read_everywhere(config_module: Any, name: str) -> Any:
    """A dynamo or inductor setting as a thread without a value of its own reads it: the value
    the lanes and autograd's threads compile with (see `write_everywhere`)."""
    return Context().run(getattr, config_module, name)


def write_everywhere(config_module: Any, name: str, value: Any) -> None:
    """Set a dynamo or inductor setting for every thread that has no value of its own.

    torch >= 2.12 keeps a value written to its config modules per thread (a ``ContextVar`` per
    setting), so a setting written where a pipe opens would reach neither the lane threads that
    compile the layers nor autograd's device threads that compile a backward lazily. There the
    value becomes the setting's default, which every thread without a value of its own reads (a
    thread's own value, such as a user's ``config.patch``, stays theirs); on older torch the
    write is process-wide already. Limit: a thread that computed the config's hash before the
    change (an autograd thread that compiled for an earlier pipe) keeps that cached hash, part of
    inductor's cache key, until it writes a setting itself."""
    entries: dict[str, Any] = config_module.__dict__.get("_config", {})
    entry: Any = entries.get(name)
    if isinstance(getattr(entry, "user_override", None), ContextVar):
        entry.default = value
    else:
        setattr(config_module, name, value)


@contextlib.contextmanager
def settings_everywhere(config_module: Any, options: dict[str, Any]) -> Iterator[None]:
    """``options`` set for every thread (`write_everywhere`) inside the block, then what they were
    (`read_everywhere`)."""
    before = {name: read_everywhere(config_module, name) for name in options}
    for name, value in options.items():
        write_everywhere(config_module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            write_everywhere(config_module, name, value)


def _read_cpp_wrapper() -> bool:
    import torch._inductor.config as inductor_config

    return bool(read_everywhere(inductor_config, "cpp_wrapper"))


def _write_cpp_wrapper(on: bool) -> None:
    import torch._inductor.config as inductor_config

    write_everywhere(inductor_config, "cpp_wrapper", on)


# Inductor's process-wide ``cpp_wrapper``, on while at least one compiling CUDA pipe is open.
# Process-wide and held: a lazily compiled backward reads the global setting (module docstring);
# while a pipe is open the user's own compiles use the C++ wrapper too.
CPP_WRAPPER: HeldSetting[bool] = HeldSetting(_read_cpp_wrapper, _write_cpp_wrapper, lambda found: True)


def _read_recompile_limit() -> int:
    import torch._dynamo.config as dynamo_config

    return int(read_everywhere(dynamo_config, "recompile_limit"))


def _write_recompile_limit(limit: int) -> None:
    import torch._dynamo.config as dynamo_config

    write_everywhere(dynamo_config, "recompile_limit", limit)


# Graphs a compiled layer's code may hold before dynamo runs further variants eagerly: while a
# compiling pipe is open, at least `LAYER_GRAPH_VARIANTS`. All layers of a class share one code
# object and so one cache, and its variants multiply: grad mode, whether the input needs a
# gradient, and per attention type (GPT-OSS's sliding and full layers, whose window the fused
# kernel takes as an argument). On an H100 GPT-OSS-20B's decoder layer reached dynamo's default
# of 8 and ran eagerly from there on; a CPU run of a LoRA'd GPT-OSS made 5.
LAYER_GRAPH_VARIANTS = 64
RECOMPILE_LIMIT: HeldSetting[int] = HeldSetting(
    _read_recompile_limit, _write_recompile_limit, lambda found: max(found, LAYER_GRAPH_VARIANTS)
)


def _cpp_compiler() -> bool:
    """Whether a C++ compiler is there to build the wrapper (without one, the Python wrapper)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return any(shutil.which(name) for name in names)


def compile_enabled(setting: CompileSetting, device_type: str) -> bool:
    """Whether layers on ``device_type`` are compiled for ``RunConfig.compile=setting``."""
    if setting is False:
        return False
    if setting == "auto":
        return device_type == "cuda" and importlib.util.find_spec("triton") is not None
    if not hasattr(nn.Module, "compile"):
        raise ConfigError(
            f"RunConfig.compile=True needs torch >= 2.2 (this is {torch.__version__}); "
            'upgrade torch or use compile="auto"'
        )
    return True


class LayerCompiler:
    """Prepares roundpipe's own copies of a layer (replicas, profile copies) for one run:
    ``prepare(module)`` lets the layer adapt its copy (``roundpipe_replica()``, e.g. a decoder
    block slicing its MLP over long sequences), hands its sliced modules the run's `slicing`
    switch, then compiles it (in place) or not."""

    def __init__(
        self,
        setting: CompileSetting,
        device_type: str,
        compiler: Compiler | None = None,
    ) -> None:
        self.enabled = compile_enabled(setting, device_type)
        self.explicit = setting is True
        self.compiler = compiler or Compiler(**default_options(device_type))
        # Compiled kernels launch from inductor's C++ wrapper while this run is open (`open`).
        self.cpp_wrapper = self.enabled and wants_cpp_wrapper(device_type)
        self._held: list[HeldSetting[Any]] = []
        # Whether the copies slice long rows; one object for all, so that switching reaches them all.
        self.slicing = LongRowSlicing()

    def open(self) -> None:
        """Turn on what compiling this run needs beyond its options (the C++ wrapper, room for
        the layers' graph variants); once."""
        if self._held or not self.enabled:
            return
        self._held = [RECOMPILE_LIMIT, *([CPP_WRAPPER] if self.cpp_wrapper else [])]
        for setting in self._held:
            setting.acquire()

    def close(self) -> None:
        """Give back what `open` turned on. Idempotent."""
        held, self._held = self._held, []
        for setting in reversed(held):
            setting.release()

    def prepare(self, module: nn.Module) -> nn.Module:
        adapt: Any = getattr(module, "roundpipe_replica", None)
        if callable(adapt):
            adapt()
        attach_slicing(module, self.slicing)
        if not self.enabled:
            return module
        if self.cpp_wrapper or _read_cpp_wrapper():  # ours, or chosen in the environment
            dispatch_products(module)  # the grouped products it can call (module docstring)
        hook: Any = getattr(module, "roundpipe_compile", None)
        if callable(hook):
            hook(self.compiler)
        elif self.explicit:
            self.compiler.module(module)
        return module


class CompileGarbage:
    """Frees the cyclic garbage that compiling leaves behind, as soon as compiling happened.

    Why: tracing and compiling a layer (its forward at the first call, its backward at the first
    backward) builds thousands of Python objects in reference cycles that also hold the real
    tensors of that call: activations, gradients, weights. Only a full collection frees them,
    and the interpreter runs one rarely. On an H200, A under a 4 GiB budget ran out of memory in
    its second iteration with 129 activation-sized tensors (2 GiB) held that way; a CPU run of a
    4-layer model keeps 135 of its 171 activation-shaped tensors after the first iteration until
    a full collection. The dynamo/inductor counters move only while compiling, so a changed total
    after a task means that task compiled something: collect then, never otherwise.
    """

    def __init__(self) -> None:
        self._seen = self._activity()
        self._lock = threading.Lock()

    @staticmethod
    def _activity() -> int:
        from torch._dynamo.utils import counters

        return sum(sum(kinds.values()) for kinds in list(counters.values()))

    def collect_if_compiled(self) -> bool:
        """A full collection if anything was compiled since the last call; whether one ran."""
        with self._lock:
            activity = self._activity()
            if activity == self._seen:
                return False
            gc.collect()
            self._seen = self._activity()
            return True


NO_COMPILE = LayerCompiler(False, "cpu")
