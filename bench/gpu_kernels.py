"""Where a decoder layer's and the LM head's GPU time goes, and what compiling them would buy.

Why: on the GPU the throughput workloads are bound by compute (the GPU is busy ~99% of a step),
yet a step costs about 2.5x the matmul floor. The question this answers, for one layer of the
workload's shape at the tokens of one microbatch, is how much of a layer's forward, recompute and
backward is matrix work, attention and memory-bound glue (norms, rotary, SwiGLU, residuals); how
much ``torch.compile`` removes, and whether a compiled layer stays one graph when (as in
roundpipe's replicas) its parameter slots are rebound to other tensors on every call; and what the
chunked LM-head loss costs per chunk size. One JSON line per measurement.

``--parts launch``: how long the host takes to issue one layer's forward and forward-backward
against how long the GPU takes to run them, eager, compiled, and captured as CUDA graphs
(`torch.cuda.make_graphed_callables`, and inductor's ``mode="reduce-overhead"``). Where the host
time nears the GPU time, a stage's launches pace the device (the CUDA backend's "host-bound"
share); this is the bound on what CUDA graphs per layer could give back.

    python bench/gpu_kernels.py --tokens 16384                 # Qwen3-1.7B shape, one microbatch of B
    python bench/gpu_kernels.py --tokens 16384 --no-compile    # eager only
    python bench/gpu_kernels.py --tokens 4096 --seq 4096 --parts launch   # a microbatch of A
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_throughput import QWEN3_1_7B

from roundpipe.model.loss import chunked_cross_entropy


def timed(fn: Callable[[], Any], repeat: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]


def timed_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn``: CUDA events on a GPU (`timed`), the wall clock elsewhere
    (the benches' CPU smoke runs)."""
    if device.type == "cuda":
        return timed(fn, repeat=repeats)
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - began) * 1000)
    return sorted(samples)[len(samples) // 2]


def kernel_categories(fn: Callable[[], Any]) -> dict[str, float]:
    """CUDA milliseconds of one call of ``fn`` by kernel family, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.lower()
        us: float = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0) or 0.0
        if us <= 0 or event.key.startswith("aten::") or event.key.startswith("cuda"):
            continue
        if any(k in name for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "wgmma", "matmul")):
            family = "matmul"
        elif any(k in name for k in ("flash", "fmha", "attention", "sdpa")):
            family = "attention"
        elif "triton" in name:
            family = "triton (fused)"
        elif any(k in name for k in ("reduce", "norm", "softmax", "logsumexp")):
            family = "reductions"
        elif any(k in name for k in ("copy", "memcpy", "memset", "cat")):
            family = "copies"
        else:
            family = "elementwise"
        totals[family] = totals.get(family, 0.0) + us / 1000.0
    return {k: round(v, 3) for k, v in sorted(totals.items())}


def layer_parts(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    s = QWEN3_1_7B
    config = Qwen3Config(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=2,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=max(args.seq, 4096),
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Qwen3DecoderLayer(config, layer_idx=0).to("cuda", torch.bfloat16)
    rotary = Qwen3RotaryEmbedding(config).to("cuda")
    return config, layer, rotary


def layer_inputs(
    args: argparse.Namespace,
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer on the GPU, a microbatch of hidden states for it (``args.tokens`` tokens in
    sequences of ``args.seq``), its rotary (cos, sin) and an output gradient."""
    _, layer, rotary = layer_parts(args)
    hidden = torch.randn(
        args.tokens // args.seq, args.seq, layer.hidden_size, device="cuda", dtype=torch.bfloat16
    )
    positions = torch.arange(args.seq, device="cuda")[None].expand(hidden.shape[0], -1)
    cos, sin = rotary(hidden, positions)
    return layer, hidden, cos, sin, torch.randn_like(hidden)


def layer_lines(args: argparse.Namespace, compile_layer: bool) -> list[dict[str, Any]]:
    layer, hidden, cos, sin, grad_out = layer_inputs(args)
    batch = hidden.shape[0]
    flops_fwd = 2 * args.tokens * sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    flops_fwd += 2 * 2 * batch * args.seq * args.seq * layer.self_attn.config.num_attention_heads * 128 // 2

    def run(module: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
        def forward() -> Any:
            with torch.no_grad():
                return module(hidden, attention_mask=None, position_embeddings=(cos, sin))

        def forward_backward() -> Any:
            x = hidden.detach().requires_grad_(True)
            out = module(x, attention_mask=None, position_embeddings=(cos, sin))
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad_out)
            return x.grad

        return forward, forward_backward

    lines = []
    reference = run(layer)[1]()
    for name, module in (("eager", layer), ("compiled", None)):
        if name == "compiled":
            if not compile_layer:
                continue
            started = time.perf_counter()
            module = torch.compile(layer)
            forward, forward_backward = run(module)
            got = forward_backward()
            compile_s = time.perf_counter() - started
            err = (got.float() - reference.float()).abs().max().item() / reference.float().abs().max().item()
        else:
            forward, forward_backward = run(module)
            compile_s, err = 0.0, 0.0
        layer.zero_grad(set_to_none=True)
        fwd_ms, fb_ms = timed(forward), timed(forward_backward)
        lines.append(
            {
                "bench": "gpu_kernels",
                "part": "decoder_layer",
                "variant": name,
                "tokens": args.tokens,
                "forward_ms": round(fwd_ms, 3),
                "forward_backward_ms": round(fb_ms, 3),
                "tflops_forward": round(flops_fwd / fwd_ms / 1e9, 1),
                "tflops_forward_backward": round(3 * flops_fwd / fb_ms / 1e9, 1),
                "compile_s": round(compile_s, 1),
                "grad_rel_err_vs_eager": err,
                "kernels_forward_backward_ms": kernel_categories(forward_backward),
            }
        )
    if compile_layer:
        lines.append(rebinding_line(layer, hidden, cos, sin))
    return lines


def rebinding_line(layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, Any]:
    """Four structural copies of the layer compiled once each, their parameter slots rebound to
    fresh tensors on every call (as roundpipe's replicas do): how many graphs dynamo builds."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    copies = [copy.deepcopy(layer) for _ in range(4)]
    compiled = [torch.compile(c) for c in copies]
    started = time.perf_counter()
    for step in range(2):
        for c, fn in zip(copies, compiled, strict=True):
            for module in c.modules():
                for leaf, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[leaf] = p.detach().clone().requires_grad_(step == 1)
            out = fn(hidden, attention_mask=None, position_embeddings=(cos, sin))
            out = out[0] if isinstance(out, tuple) else out
            if step == 1:
                out.float().sum().backward()
    torch.cuda.synchronize()
    return {
        "bench": "gpu_kernels",
        "part": "rebinding",
        "copies": 4,
        "calls": 8,
        "frames_compiled": int(sum(counters["stats"].get(k, 0) for k in ("unique_graphs",))),
        "counters": {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles")},
        "seconds": round(time.perf_counter() - started, 1),
    }


def host_and_device_ms(fn: Callable[[], Any], repeat: int = 10, warmup: int = 3) -> tuple[float, float]:
    """Median (host ms to issue ``fn``, GPU ms to run it), each call started on an idle device: the
    host figure is the Python and launch work alone (a backward returns once its kernels are
    queued), the GPU figure that of the kernels."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host, device = [], []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        # Hold the stream behind a short sleep so that no kernel of ``fn`` can start (and delay
        # the host's launches) before the host has issued them all.
        torch.cuda._sleep(50_000_000)  # about 25 ms at the H200's clock
        start.record()
        issued = time.perf_counter()
        fn()
        host.append((time.perf_counter() - issued) * 1e3)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    return sorted(host)[len(host) // 2], sorted(device)[len(device) // 2]


def launch_lines(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Host issue time against GPU time for one decoder layer, per way of running it."""
    layer, hidden, cos, sin, grad_out = layer_inputs(args)

    class Positional(torch.nn.Module):
        """The layer with tensor arguments only, as `make_graphed_callables` needs."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            out = self.inner(x, attention_mask=None, position_embeddings=(cos, sin))
            return out[0] if isinstance(out, tuple) else out

    def reference_grad(module: Any) -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        x = hidden.detach().requires_grad_(True)
        module(x, cos, sin).backward(grad_out)
        torch.cuda.synchronize()
        assert x.grad is not None
        return x.grad.detach().clone()

    eager = Positional(layer)
    reference = reference_grad(eager)
    variants: list[tuple[str, Callable[[], Any]]] = [
        ("eager", lambda: eager),
        ("compiled", lambda: torch.compile(Positional(layer))),
        # As a CUDA pipe compiles its layers: inductor's process-wide C++ launch wrapper on
        # (`roundpipe.backends.compiling.CPP_WRAPPER`), for the backward compiled at its first call too.
        ("compiled, C++ wrapper", lambda: torch.compile(Positional(layer))),
        ("reduce-overhead", lambda: torch.compile(Positional(layer), mode="reduce-overhead")),
        (
            "graphed",
            lambda: torch.cuda.make_graphed_callables(
                Positional(layer), (hidden.detach().requires_grad_(True), cos, sin), num_warmup_iters=3
            ),
        ),
        (
            "compiled+graphed",
            lambda: torch.cuda.make_graphed_callables(
                torch.compile(Positional(layer)),
                (hidden.detach().requires_grad_(True), cos, sin),
                num_warmup_iters=3,
            ),
        ),
    ]
    lines: list[dict[str, Any]] = []
    from torch._inductor import config as inductor_config

    for name, make in variants:
        wrapper_found = inductor_config.cpp_wrapper
        inductor_config.cpp_wrapper = name.endswith("C++ wrapper")
        line: dict[str, Any] = {
            "bench": "gpu_kernels",
            "part": "launch",
            "variant": name,
            "tokens": args.tokens,
        }
        try:
            # Fresh compiles: the wrappers share one forward's code and the layer's parameters, so
            # dynamo would otherwise reuse the previous variant's graph (compiled without the wrapper).
            torch._dynamo.reset()
            started = time.perf_counter()
            module = make()
            got = reference_grad(module)
            line["build_s"] = round(time.perf_counter() - started, 1)
            line["grad_rel_err_vs_eager"] = (got.float() - reference.float()).abs().max().item() / (
                reference.float().abs().max().item()
            )

            def forward(module: Any = module) -> Any:
                with torch.no_grad():
                    return module(hidden, cos, sin)

            def forward_backward(module: Any = module) -> Any:
                x = hidden.detach().requires_grad_(True)
                module(x, cos, sin).backward(grad_out)

            # make_graphed_callables captures the forward with autograd only: no forward-only line.
            parts = [("forward_backward", forward_backward)]
            if not name.endswith("graphed"):
                parts.insert(0, ("forward", forward))
            for what, fn in parts:
                host_ms, device_ms = host_and_device_ms(fn)
                line[f"{what}_host_ms"] = round(host_ms, 3)
                line[f"{what}_gpu_ms"] = round(device_ms, 3)
        except Exception as error:  # a variant this torch cannot run: say so, go on
            first_line = (str(error).splitlines() or [""])[0]
            line["error"] = f"{type(error).__name__}: {first_line[:300]}"
        finally:
            inductor_config.cpp_wrapper = wrapper_found
        lines.append(line)
        print(json.dumps(line), file=sys.stderr, flush=True)
    return lines


def head_lines(args: argparse.Namespace) -> list[dict[str, Any]]:
    s = QWEN3_1_7B
    hidden = torch.randn(args.tokens, s.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(s.vocab, s.hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    labels = torch.randint(0, s.vocab, (args.tokens,), device="cuda")
    flops = 3 * 2 * args.tokens * s.vocab * s.hidden
    from roundpipe.model.loss import softmax_cross_entropy_grad

    compiled = torch.compile(softmax_cross_entropy_grad, dynamic=True)
    lines = []
    for kernel_name, kernel in (("eager", None), ("compiled", compiled)):
        for chunk in (256, 384, 1024, 2048):

            def fb(chunk: int = chunk, kernel: Any = kernel) -> None:
                hidden.grad = weight.grad = None
                chunked_cross_entropy(hidden, weight, labels, chunk, kernel=kernel).backward()

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = timed(fb, repeat=5, warmup=2)
            lines.append(
                {
                    "bench": "gpu_kernels",
                    "part": "lm_head_loss",
                    "kernel": kernel_name,
                    "chunk_tokens": chunk,
                    "tokens": args.tokens,
                    "forward_backward_ms": round(ms, 2),
                    "tflops_as_3_matmuls": round(flops / ms / 1e9, 1),
                    "extra_peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3),
                }
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens of one microbatch")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--parts", default="layer,head", help="layer, head, launch (comma list)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    lines = layer_lines(args, args.compile) if "layer" in parts else []
    lines += launch_lines(args) if "launch" in parts else []
    for line in [*lines, *(head_lines(args) if "head" in parts else [])]:
        text = json.dumps(line)
        print(text, flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
