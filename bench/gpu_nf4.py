"""The 4-bit base on a GPU: is roundpipe's NF4 right, and what does dequantizing inside the layer cost?

Why: a frozen NF4 base crosses the host link in a quarter of bf16's bytes, but every layer call
dequantizes its weight on the device (twice per backward stage: forward and backward). This
measures, on the weights of one 32B-shaped decoder layer (Qwen3-32B: hidden 5120, MLP 25600,
64 query and 8 key/value heads of 128; ``--shapes`` for others), for a microbatch of ``--tokens``:
- correctness: the bytes and the dequantized weight against bitsandbytes (when importable), the
  round-trip error against the bf16 weight;
- dequantization alone, in GB/s of bf16 weight written: `roundpipe.model.quant.dequantize_nf4` as
  it runs here, the Triton kernel of `roundpipe.model.nf4_triton` (its default launch shape and a
  few others, to choose from), the torch path it replaced eager and ``torch.compile``d, and
  bitsandbytes / torchao where importable; the kernel's bits against the torch path's;
- the layer: `NF4Linear` forward and forward+backward (eager and compiled dequant) against bf16
  ``F.linear`` on the dense weight, with the bytes each holds.
One JSON line per result.

    python bench/gpu_nf4.py                      # 32B-shaped weights, 8192 tokens
    python bench/gpu_nf4.py --tokens 16384 --repeats 50
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))
from gpu_kernels import timed

from roundpipe.model import nf4, nf4_triton
from roundpipe.model.quant import NF4Linear, NF4Weight, dequantize_nf4, quantize_nf4

SHAPES_32B = {
    "q_proj": (8192, 5120),
    "k_proj": (1024, 5120),
    "o_proj": (5120, 8192),
    "gate_proj": (25600, 5120),
    "down_proj": (5120, 25600),
}


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def optional(name: str) -> Any:
    try:
        return __import__(name)
    except Exception:  # absent, or present but unable to load on this machine
        return None


# (bytes per program, warps, paired) of the kernel's launches timed beside its default.
LAUNCH_SHAPES = ((512, 4, True), (1024, 8, True), (2048, 4, True), (1024, 8, False), (2048, 8, False))
_torch_compiled: Any = None


def torch_path(q: NF4Weight, compiled: bool = False) -> torch.Tensor:
    """``q`` in bf16 by `roundpipe.model.nf4`'s torch ops, eager or ``torch.compile``d."""
    global _torch_compiled
    fn: Any = nf4._dequantize_torch
    if compiled:
        if _torch_compiled is None:
            _torch_compiled = torch.compile(nf4._dequantize_torch, dynamic=False)
        fn = _torch_compiled
    out: torch.Tensor = fn(q.packed, q.absmax, q.block_size, torch.bfloat16)
    return out.view(q.shape)


def dequantizers() -> dict[str, Callable[[NF4Weight], torch.Tensor]]:
    """Every way to dequantize here, by name: roundpipe's own choice, the torch path eager and
    compiled, and the Triton kernel where it can run."""
    found: dict[str, Callable[[NF4Weight], torch.Tensor]] = {
        "roundpipe": lambda q: dequantize_nf4(q, torch.bfloat16),
        "torch_eager": torch_path,
        "torch_compiled": lambda q: torch_path(q, compiled=True),
    }
    if nf4_triton.available():
        found["triton"] = lambda q: nf4_triton.dequantize_nf4_cuda(
            q.packed, q.absmax, q.block_size, torch.bfloat16
        ).view(q.shape)
    return found


def triton_launches(q: NF4Weight) -> dict[str, Callable[[], Any]]:
    """The kernel at each of `LAUNCH_SHAPES`, into one output, by name."""
    if not nf4_triton.available():
        return {}
    out = torch.empty(q.numel, dtype=torch.bfloat16, device=q.packed.device)
    return {
        f"triton_{size}b_{warps}w{'' if paired else '_per_element'}": functools.partial(
            nf4_triton._launch,
            q.packed,
            q.absmax,
            q.block_size,
            out,
            bytes_per_program=size,
            num_warps=warps,
            paired=paired,
        )
        for size, warps, paired in LAUNCH_SHAPES
    }


def bits_against_torch(q: NF4Weight) -> dict[str, bool]:
    """Whether each way to dequantize (and each timed launch of the kernel) writes the torch
    path's bits, by name."""
    reference = torch_path(q).view(torch.int16)
    same = {
        path: bool(torch.equal(fn(q).view(torch.int16), reference)) for path, fn in dequantizers().items()
    }
    for path, launch in triton_launches(q).items():
        same[path] = bool(torch.equal(launch().view(q.shape).view(torch.int16), reference))
    return same


def check_bitsandbytes(name: str, weight: torch.Tensor) -> Callable[[], Any] | None:
    bnb = optional("bitsandbytes")
    if bnb is None:
        emit(name=name, check="bitsandbytes", available=False)
        return None
    import bitsandbytes.functional as bf

    packed, state = bf.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    q = quantize_nf4(weight)
    same_bytes = bool(torch.equal(packed.view(-1), q.packed)) and bool(torch.equal(state.absmax, q.absmax))
    theirs = bf.dequantize_4bit(packed, state)
    same_weight = {path: bool(torch.equal(theirs, fn(q))) for path, fn in dequantizers().items()}
    emit(name=name, check="bitsandbytes", available=True, same_bytes=same_bytes, same_weight=same_weight)
    return lambda: bf.dequantize_4bit(packed, state)


def torchao_dequant(weight: torch.Tensor) -> Callable[[], Any] | None:
    if optional("torchao") is None:
        return None
    try:
        from torchao.dtypes.nf4tensor import to_nf4

        nf4 = to_nf4(weight, 64, 256)
        return lambda: nf4.get_original_weight()
    except Exception as exc:
        emit(check="torchao", available=True, error=f"{type(exc).__name__}: {exc}")
        return None


def one_shape(name: str, shape: tuple[int, int], tokens: int, repeats: int) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
    q = quantize_nf4(weight)
    dense = dequantize_nf4(q)
    error = (dense.float() - weight.float()).abs()
    compiled_equal = bool(torch.equal(dequantize_nf4(q, compiled=True), dense))
    emit(
        name=name,
        shape=list(shape),
        nf4_bytes=q.nbytes,
        bf16_bytes=weight.numel() * 2,
        ratio=q.nbytes / (weight.numel() * 2),
        max_abs_error=float(error.max()),
        mean_abs_error=float(error.mean()),
        compiled_equals_eager=compiled_equal,
        bits_equal_to_the_torch_path=bits_against_torch(q),
        triton=nf4_triton.available(),
    )
    written = weight.numel() * 2 / 1e9
    candidates: dict[str, Callable[[], Any] | None] = {
        **{path: functools.partial(fn, q) for path, fn in dequantizers().items()},
        **triton_launches(q),
        "bitsandbytes": check_bitsandbytes(name, weight),
        "torchao": torchao_dequant(weight),
    }
    for impl, fn in candidates.items():
        if fn is not None:
            ms = timed(fn, repeat=repeats)
            emit(name=name, part="dequant", impl=impl, ms=ms, gb_per_s=written / (ms / 1e3))
    x = torch.randn(tokens, shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer = NF4Linear(q).cuda()

    def dense_fwd_bwd() -> None:
        F.linear(x, weight).sum().backward()

    def nf4_fwd_bwd() -> None:
        layer(x).sum().backward()

    out = layer(x)
    torch.testing.assert_close(out, F.linear(x, dense), rtol=0, atol=0)
    flops = 2 * tokens * shape[0] * shape[1]
    runs: list[tuple[str, str, Callable[[], Any], int]] = [
        ("bf16_linear", "forward", lambda: F.linear(x, weight), 1),
        ("bf16_linear", "forward_backward", dense_fwd_bwd, 2),
    ]
    for compiled in (False, True):
        label = "nf4_linear_compiled" if compiled else "nf4_linear_eager"
        runs.append((label, "forward", _switched(layer, compiled, lambda: layer(x)), 1))
        runs.append((label, "forward_backward", _switched(layer, compiled, nf4_fwd_bwd), 2))
    for impl, part, fn, matmuls in runs:
        with torch.no_grad() if part == "forward" else torch.enable_grad():
            ms = timed(fn, repeat=repeats)
        emit(
            name=name, part=part, impl=impl, tokens=tokens, ms=ms, tflops=matmuls * flops / (ms / 1e3) / 1e12
        )
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    nf4_fwd_bwd()
    emit(
        name=name,
        part="memory",
        impl="nf4_linear_eager",
        peak_above_start=torch.cuda.max_memory_allocated() - base,
    )


def _switched(layer: NF4Linear, compiled: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with the layer's dequantization compiled or eager."""

    def run() -> Any:
        layer.compiled = compiled
        try:
            return fn()
        finally:
            layer.compiled = False

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of one microbatch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default=",".join(SHAPES_32B), help="comma-separated names of SHAPES_32B")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        emit(error="needs CUDA")
        return
    emit(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        bitsandbytes=getattr(optional("bitsandbytes"), "__version__", None),
        torchao=getattr(optional("torchao"), "__version__", None),
    )
    for name in args.shapes.split(","):
        one_shape(name, SHAPES_32B[name], args.tokens, args.repeats)


if __name__ == "__main__":
    main()
