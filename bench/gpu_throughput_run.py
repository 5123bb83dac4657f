"""The pieces `gpu_throughput.py` runs both sides with: shapes, model, batch, optimizer, probes.

Kept apart from the command line so each piece is small enough to be obviously right on a GPU
it was never run on: every CUDA call here is guarded by the device list it is given (empty on
CPU), so a CPU smoke run exercises the same code. It must never decide what runs nor print a result.
"""

from __future__ import annotations

import re
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend

GIB = 1 << 30
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    family: str = "qwen3"  # one of `gpu_models.FAMILIES`
    experts: int = 0  # mixtures of experts: experts per layer (``intermediate``: per expert)
    experts_per_token: int = 0
    sliding_window: int = 0  # gpt_oss: the window of its alternate (sliding) layers

    def param_count(self) -> int:
        """Parameters of the model of this shape (embedding, decoder layers, norms, head): by
        formula for Qwen3, counted on a meta-device skeleton for the other families."""
        if self.family != "qwen3":
            from gpu_models import meta_param_count

            return meta_param_count(self)
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q, k, v, o and q/k norms
        layer = attention + 3 * h * self.intermediate + 2 * h  # MLP and the two layer norms
        embeddings = self.vocab * h * (1 if self.tied else 2)
        return embeddings + self.layers * layer + h


@dataclass(frozen=True)
class Workload:
    name: str
    shape: Shape
    batch: int
    seq: int
    microbatches: int
    lora_r: int = 0
    budget: str | None = None
    recompute_grain: str = "auto"  # RunConfig's default; the grain it chose is in the JSON
    base_format: str = "bf16"  # "nf4": each decoder layer's frozen linears held and moved in 4 bits
    layerwise: bool = False  # build one layer at a time on the device (`gpu_models.build_layerwise`)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def lora_param_count(self) -> int:
        s = self.shape
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        per_layer = (s.hidden + q) + 2 * (s.hidden + kv) + (q + s.hidden)  # A and B of q, k, v, o
        return self.lora_r * per_layer * s.layers


def parse_size(text: str) -> int:
    """``"24GiB"`` -> 25769803776; ``"1.5 GB"`` -> 1500000000; a bare number is bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is not understood; write e.g. 24GiB, 512MiB, 8GB or bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def build_model(workload: Workload, dtype: torch.dtype, init_on_gpu: bool = False) -> torch.nn.Module:
    """A randomly initialised (seeded) Qwen3 of the workload's shape with sdpa attention, built
    directly in ``dtype``; with peft LoRA adapters on q/k/v/o when ``workload.lora_r`` > 0.

    ``init_on_gpu``: draw the random weights on the first GPU and return the model on the host
    (a 1.7B model's initialisation takes about a minute on the host, under a second there). Both
    sides of a comparison must build the same way: the two generators draw different weights."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if workload.layerwise or workload.base_format != "bf16" or workload.shape.family != "qwen3":
        from gpu_models import build_layerwise

        use_gpu = init_on_gpu and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
        s = workload.shape
        return build_layerwise(s, workload.seq, workload.lora_r, workload.base_format, dtype, device)
    s = workload.shape
    config = Qwen3Config(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=max(workload.seq, 4096),
        tie_word_embeddings=s.tied,
        use_cache=False,
    )
    torch.manual_seed(0)
    if init_on_gpu and torch.cuda.is_available():
        with torch.device("cuda"):
            model = _from_config(AutoModelForCausalLM, config, dtype)
        model = model.to("cpu")
        torch.cuda.empty_cache()
    else:
        model = _from_config(AutoModelForCausalLM, config, dtype)
    if workload.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=workload.lora_r, lora_alpha=2 * workload.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS
        )
        torch.manual_seed(1)
        model = get_peft_model(model, lora)
    return model


def _from_config(auto: Any, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """transformers 5 takes ``dtype``; older releases took ``torch_dtype``. Whichever is honoured,
    the result is in ``dtype`` (cast as a last resort)."""
    model: torch.nn.Module | None = None
    for key in ("dtype", "torch_dtype"):
        try:
            model = auto.from_config(config, attn_implementation="sdpa", **{key: dtype})
        except TypeError:
            continue
        break
    if model is None:
        model = auto.from_config(config, attn_implementation="sdpa")
    if any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
        model = model.to(dtype)
    return model


def cuda_indices(devices: str) -> tuple[int, ...]:
    """The CUDA devices a ``--devices`` value names (none for CPU workers)."""
    from roundpipe.config import parse_devices

    spec = parse_devices(devices)
    return spec.indices if spec.kind == "cuda" else ()


def model_dtype(choice: str, cuda: bool) -> torch.dtype:
    """bf16 on CUDA (no fp32 host copy of a large base), fp32 elsewhere, unless told."""
    if choice == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return torch.bfloat16 if choice == "bf16" else torch.float32


def device_names(devices: str) -> list[str]:
    if not devices.startswith("cuda") or not torch.cuda.is_available():
        return [devices]
    from roundpipe.config import parse_devices

    return [torch.cuda.get_device_name(i) for i in parse_devices(devices).indices]


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def make_batch(workload: Workload) -> dict[str, torch.Tensor]:
    """Seeded random token ids; the labels are the inputs (the model shifts them)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, workload.shape.vocab, (workload.batch, workload.seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def adamw(used: list[str]) -> Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer]:
    """AdamW(lr=1e-4), fused where the parameters' device supports it (CPU: torch >= 2.4),
    else foreach; appends which one it built to ``used`` so the report can say."""

    def factory(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        try:
            optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
            used.append("adamw-fused")
        except (RuntimeError, ValueError, TypeError):
            optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
            used.append("adamw-foreach")
        return optimizer

    return factory


# The sdpa backends by the names the benches take (--sdpa-first, bench/gpu_attention.py).
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_choice(heads: int, kv_heads: int, head_dim: int, device: torch.device) -> str | None:
    """The sdpa backend torch picks on ``device`` for causal bf16 attention of these heads
    (grouped as transformers calls it), under the order and switches in force, by its
    `SDPBackend` name in lower case. None where torch cannot say."""
    choice: Callable[..., int] | None = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return None
    q = torch.zeros(1, heads, 128, head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.zeros(1, kv_heads, 128, head_dim, device=device, dtype=torch.bfloat16)
    try:
        index = int(choice(q, kv, kv, None, 0.0, True, enable_gqa=kv_heads != heads))
    except RuntimeError:  # no backend takes it under the switches in force
        return None
    names = {int(b.value): b.name.lower() for b in SDPBackend.__members__.values()}
    return names.get(index, str(index))


def attention_backend(shape: Shape, device: torch.device) -> str | None:
    """`sdpa_choice` for ``shape``'s heads: what the layers run where they trace or call sdpa now."""
    return sdpa_choice(shape.heads, shape.kv_heads, shape.head_dim, device)


def reset_peaks(indices: Sequence[int]) -> None:
    for index in indices:
        torch.cuda.synchronize(index)  # initialises the device: resetting an unused one is an error
        torch.cuda.reset_peak_memory_stats(index)


def sync_devices(indices: Sequence[int]) -> None:
    for index in indices:
        torch.cuda.synchronize(index)


def allocated_memory(indices: Sequence[int]) -> dict[str, float]:
    """GiB allocated now per CUDA device (empty on CPU)."""
    return {f"cuda:{i}": round(torch.cuda.memory_allocated(i) / GIB, 3) for i in indices}


def device_memory(indices: Sequence[int]) -> dict[str, float]:
    """Peak allocated GiB per CUDA device since the last reset (empty on CPU)."""
    return {f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / GIB, 3) for i in indices}


def predicted_memory(pipe: Any) -> dict[str, Any]:
    """The planner's memory prediction, where the pipe exposes one (``plan_memory`` or
    ``memory_prediction``, on the pipe or its plan; a value or a method), as JSON-ready data,
    and the predicted peak in GiB when it can be read off as a number of bytes."""
    for owner in (pipe, getattr(pipe, "plan", None)):
        for name in ("plan_memory", "memory_prediction"):
            value = getattr(owner, name, None)
            if callable(value):
                try:
                    value = value()
                except Exception as exc:  # a prediction that cannot be read is reported, not fatal
                    value = f"{name}() raised {type(exc).__name__}: {exc}"
            if value is not None:
                return {"predicted_memory": _jsonable(value), "predicted_peak_gib": _peak_gib(value)}
    return {"predicted_memory": None, "predicted_peak_gib": None}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    if isinstance(value, dict | list | tuple | int | float | str | bool):
        return value
    return str(value)


def _peak_gib(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return round(value / GIB, 3)
    for key in ("peak_bytes", "total_bytes", "predicted_bytes", "bytes"):
        found = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        if isinstance(found, int | float) and not isinstance(found, bool):
            return round(found / GIB, 3)
    return None


class RssSampler:
    """Samples this process's resident set size every 0.1 s while in use: peak and final GiB."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.peak = 0

    @staticmethod
    def current() -> int:
        try:
            with open("/proc/self/statm") as f:
                pages = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            return 0
        import os

        return pages * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.current())
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict[str, float]:
        end = self.current()
        return {"peak": round(max(self.peak, end) / GIB, 3), "end": round(end / GIB, 3)}


def run_plain(workload: Workload, devices: str, warmup: int, steps: int) -> dict[str, Any]:
    """Whole model on one device in bf16, gradient checkpointing, fused AdamW there; the same
    microbatches with loss / M accumulated. Runs in the plain loop's own process."""
    device = torch.device("cuda", _first_cuda(devices)) if devices.startswith("cuda") else torch.device("cpu")
    indices = (device.index,) if device.type == "cuda" else ()
    if indices and workload.budget is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(workload.budget) / total), device)
    optimizers: list[str] = []
    try:
        model: Any = build_model(workload, torch.bfloat16, init_on_gpu=True).to(device)
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = adamw(optimizers)([p for p in model.parameters() if p.requires_grad])
        data = {k: v.to(device) for k, v in make_batch(workload).items()}
        chunks = {k: v.chunk(workload.microbatches) for k, v in data.items()}
        micro = [{k: parts[i] for k, parts in chunks.items()} for i in range(len(chunks["input_ids"]))]
        times: list[float] = []
        losses: list[float] = []
        for i in range(warmup + steps):
            if i == warmup:
                reset_peaks(indices)
            sync_devices(indices)
            start = time.perf_counter()
            step_loss = torch.zeros((), device=device)
            for batch in micro:
                loss = model(**batch).loss / len(micro)
                loss.backward()
                step_loss += loss.detach().float()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync_devices(indices)
            times.append(time.perf_counter() - start)
            losses.append(step_loss.item())  # after the timer: the step has synchronized already
    except torch.cuda.OutOfMemoryError as exc:
        return {"error": f"out of memory: {_first_line(exc)}", "peak_gib": device_memory(indices)}
    except Exception as exc:  # reported in the plain loop's line; the traceback goes to stderr
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {_first_line(exc)}", "peak_gib": device_memory(indices)}
    step_s = sorted(times[warmup:])[len(times[warmup:]) // 2]
    return {
        "tokens_per_s": round(workload.tokens / step_s, 1),
        "step_s_median": round(step_s, 4),
        "peak_gib": device_memory(indices),
        "device": str(device),
        "optimizer": sorted(set(optimizers)),
        "losses": [round(x, 4) for x in losses],  # every step's, warm-up included
    }


def _first_cuda(devices: str) -> int:
    match = re.fullmatch(r"cuda:(\d+).*", devices.strip())
    return int(match.group(1)) if match else 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:300]
