"""Causal grouped-query attention by sdpa backend: which kernel the workloads' layers run, at what rate.

Why: at the big-model shapes attention is a small share of a layer's forward but a larger one of
its backward (2.5x the forward's FLOPs, at a lower rate), ~28% of a mixture-of-experts layer's work
at 4,096 tokens and nearly all of a 262,144-token layer's. torch's generic order tries its own
flash kernel (FlashAttention-2) first and cuDNN's fused attention last, but on a Hopper card with a
recent cuDNN torch installs a cuDNN-first order at the first attention call. This measures, for each
workload's attention shape (one microbatch, bf16, ``is_causal=True``, ``enable_gqa=True`` as
transformers' sdpa path calls it): the backend torch picks by default, and for each of flash,
cuDNN and efficient attention the forward and forward+backward milliseconds (CUDA events, median),
their TFLOP/s, the memory a forward+backward peaks at above its inputs, and the largest difference
of the output and of each input gradient to an fp32 math reference on a 1,024-token slice of the
same shape. Last, which attention kernels a ``torch.compile``d function runs when traced under
each backend's ``sdpa_kernel`` context. One JSON line each.

    python bench/gpu_attention.py                      # on the GPU machine, well under a minute
    python bench/gpu_attention.py --device cpu --shapes tiny --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.append(str(Path(__file__).resolve().parent))
from gpu_kernels import timed_ms
from gpu_throughput_run import SDPA_BACKENDS, sdpa_choice

# name -> (query heads, key/value heads, head_dim, tokens of one microbatch)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "E": (64, 8, 128, 4096),  # Qwen3-32B; F (Llama-3.1-70B) has the same attention
    "D": (32, 4, 128, 4096),  # Qwen3-30B-A3B
    "A": (16, 8, 128, 4096),  # Qwen3-1.7B
    "G": (32, 8, 128, 65536),  # Llama-3.1-8B, a quarter of G's sequence (attention's time is ~s^2)
    "tiny": (4, 2, 16, 64),
}
BACKENDS = {name: SDPA_BACKENDS[name] for name in ("flash", "cudnn", "efficient")}  # math: the reference


def inputs(
    shape: tuple[int, int, int, int], tokens: int, device: torch.device, dtype: torch.dtype
) -> list[Any]:
    heads, kv_heads, head_dim, _ = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    made = []
    for h in (heads, kv_heads, kv_heads):
        t = torch.randn(1, h, tokens, head_dim, generator=gen).to(device, dtype)
        made.append(t.requires_grad_())
    return made


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def forward_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> list[Any]:
    out = attend(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


def errors(name: str, shape: tuple[int, int, int, int], device: torch.device) -> dict[str, float]:
    """Largest absolute difference of the output and of dq, dk, dv to fp32 math, 1,024 tokens."""
    tokens = min(shape[3], 1024)
    q, k, v = inputs(shape, tokens, device, torch.bfloat16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    with sdpa_kernel(BACKENDS[name]):
        got = forward_backward(q, k, v, grad)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        want = forward_backward(ref_in[0], ref_in[1], ref_in[2], grad.float())
    return {
        f"max_err_{part}": float((g.detach().float() - w.detach()).abs().max())
        for part, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
    }


def flops(shape: tuple[int, int, int, int]) -> float:
    """Forward FLOPs of causal attention: QK^T and PV, half the square."""
    heads, _, head_dim, tokens = shape
    return 2 * 2 * heads * head_dim * tokens * tokens / 2


def measure(name: str, shape_name: str, device: torch.device, repeats: int) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    line: dict[str, Any] = {"bench": "gpu_attention", "shape": shape_name, "backend": name}
    q, k, v = inputs(shape, shape[3], device, torch.bfloat16)
    grad = torch.randn_like(q)
    try:
        with sdpa_kernel(BACKENDS[name]):
            with torch.no_grad():
                forward_ms = timed_ms(lambda: attend(q, k, v), device, repeats)
            both_ms = timed_ms(lambda: forward_backward(q, k, v, grad), device, repeats)
            line["peak_mib_above_inputs"] = peak_above(lambda: forward_backward(q, k, v, grad), device)
        line |= errors(name, shape, device)
    except RuntimeError as exc:  # the backend refuses this shape, dtype or device
        return line | {"error": str(exc).splitlines()[0][:200]}
    fwd = flops(shape)
    backward_ms = both_ms - forward_ms
    return line | {
        "forward_ms": round(forward_ms, 3),
        "backward_ms": round(backward_ms, 3),
        "forward_tflops": round(fwd / forward_ms / 1e9, 1),
        "backward_tflops": round(2.5 * fwd / max(backward_ms, 1e-6) / 1e9, 1),  # dq, dk, dv, ds: 2.5x
    }


def peak_above(fn: Callable[[], Any], device: torch.device) -> float | None:
    """MiB the device's allocator peaked at above what was allocated before one call of ``fn``."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return round((torch.cuda.max_memory_allocated(device) - before) / 2**20, 1)


def compiled_keeps(name: str, device: torch.device) -> dict[str, Any]:
    """Kernel names of a compiled forward+backward traced under ``sdpa_kernel(name)``."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = inputs(SHAPES["D"], 1024, device, torch.bfloat16)
    grad = torch.randn_like(q)
    torch._dynamo.reset()  # dynamo caches by code object: without it, the first backend's graph
    compiled = torch.compile(forward_backward, dynamic=False)
    with sdpa_kernel(BACKENDS[name]):
        compiled(q, k, v, grad)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        compiled(q, k, v, grad)  # outside the context: the traced choice is what runs
        torch.cuda.synchronize()
    names = sorted(
        {
            e.key
            for e in prof.key_averages()
            if "attention" in e.key.lower()
            or "fmha" in e.key.lower()
            or "flash" in e.key.lower()
            or "cudnn" in e.key.lower()
        }
    )
    return {"bench": "gpu_attention", "compiled_under": name, "kernels": [n[:90] for n in names][:8]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="E,D,A,G", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, help="also append the JSON lines here")
    args = p.parse_args()
    device = torch.device(args.device)
    lines: list[dict[str, Any]] = []

    def emit(line: dict[str, Any]) -> None:  # printed as it comes: a cut-off call keeps the lines so far
        lines.append(line)
        print(json.dumps(line), flush=True)

    header: dict[str, Any] = {"bench": "gpu_attention", "torch": torch.__version__}
    if device.type == "cuda":
        header |= {"gpu": torch.cuda.get_device_name(device), "cudnn": torch.backends.cudnn.version()}
    emit(header)
    for shape_name in args.shapes.split(","):
        emit(
            {
                "bench": "gpu_attention",
                "shape": shape_name,
                "default": sdpa_choice(*SHAPES[shape_name][:3], device),
            }
        )
        for name in BACKENDS:
            emit(measure(name, shape_name, device, args.repeats))
    if device.type == "cuda":
        for name in ("flash", "cudnn"):
            emit(compiled_keeps(name, device))
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
