"""GPT-OSS attention with sinks at D2's shape: transformers' eager function against sdpa_with_sinks.

GPT-OSS-20B's attention (64 query heads, 8 key/value heads, head_dim 64) on one microbatch of
``--tokens`` tokens (default 4096), a full-attention layer (causal mask) and a sliding one (window
128), random bf16 inputs and sinks, the masks as roundpipe's presets carry them for eager attention
(additive, in the model dtype). For each mask and function: forward and backward milliseconds
(CUDA events, median of ``--repeats`` after warm-up), the peak memory above the inputs, and the
largest difference of the output and of each gradient to the eager function's. `sdpa_with_sinks`
runs twice: given the mask (the extra sink key through sdpa; the line names the backend sdpa ran,
the fused ones tried alone first) and without one (``flash_with_sinks``: the module's own mask,
flash attention and ``sigmoid(lse - sink)``). One JSON line each.

    python bench/sink_attention_gpu.py                      # on the GPU machine, well under a minute
    python bench/sink_attention_gpu.py --device cpu --tokens 256 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.append(str(Path(__file__).resolve().parent))
from gpu_kernels import timed_ms

from roundpipe.model.sink_attention import sdpa_with_sinks

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128


class Attention(torch.nn.Module):
    """What the attention functions read of their module: the sinks and the grouping."""

    def __init__(self, device: torch.device, window: int | None) -> None:
        super().__init__()
        self.sliding_window = window  # the module's own mask, when none is given
        self.sinks = torch.nn.Parameter(torch.randn(HEADS, device=device, dtype=torch.bfloat16))
        self.num_key_value_groups = HEADS // KV_HEADS
        self.training = True


def eager_function() -> Callable[..., Any]:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    return eager_attention_forward


def additive_mask(tokens: int, window: int | None, device: torch.device) -> torch.Tensor:
    index = torch.arange(tokens, device=device)
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed &= index[:, None] - index[None, :] < window
    blocked = torch.finfo(torch.bfloat16).min
    return torch.zeros(1, 1, tokens, tokens, device=device, dtype=torch.bfloat16).masked_fill(
        ~allowed, blocked
    )


def call(
    function: Callable[..., Any], module: Attention, inputs: list[torch.Tensor], mask: torch.Tensor | None
) -> Any:
    q, k, v, grad = inputs
    for t in (q, k, v):
        t.grad = None
    module.sinks.grad = None
    out, _ = function(module, q, k, v, mask, HEAD_DIM**-0.5, 0.0, s_aux=module.sinks)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad, module.sinks.grad]


def sdpa_backend(function: Callable[[], Any]) -> str:
    """The first fused backend that takes the call on its own, else the math one."""
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            with sdpa_kernel([backend]):
                function()
            return name
        except RuntimeError:
            continue
    return "math"


def measure(args: argparse.Namespace, window: int | None) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    module = Attention(device, window)
    shape = (1, HEADS, args.tokens, HEAD_DIM)
    kv_shape = (1, KV_HEADS, args.tokens, HEAD_DIM)
    inputs = [
        torch.randn(s, device=device, dtype=torch.bfloat16, requires_grad=r)
        for s, r in (
            (shape, True),
            (kv_shape, True),
            (kv_shape, True),
            ((1, args.tokens, HEADS, HEAD_DIM), False),
        )
    ]
    mask = additive_mask(args.tokens, window, device)
    lines = []
    reference: list[torch.Tensor] | None = None
    functions = (
        ("eager", eager_function(), mask),
        ("sdpa_with_sinks", sdpa_with_sinks, mask),  # the extra sink key through sdpa, with the mask
        ("flash_with_sinks", sdpa_with_sinks, None),  # no mask: flash attention and sigmoid(lse - sink)
    )
    for name, function, given in functions:
        run = lambda f=function, m=given: call(f, module, inputs, m)  # noqa: E731
        results = [t.detach().clone() for t in run()]
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        ms = timed_ms(run, device, args.repeats)
        line: dict[str, Any] = {
            "mask": "sliding" if window else "full",
            "function": name,
            "tokens": args.tokens,
        }
        line["fwd_bwd_ms"] = round(ms, 3)
        if device.type == "cuda":
            line["peak_above_inputs_gb"] = round((torch.cuda.max_memory_allocated() - before) / 1e9, 3)
        if reference is None:
            reference = results
        else:
            names = ("output", "dq", "dk", "dv", "dsinks")
            line["max_diff"] = {
                n: round(float((a.float() - b.float()).abs().max()), 5)
                for n, a, b in zip(names, results, reference, strict=True)
            }
            line["largest_output"] = round(float(reference[0].float().abs().max()), 4)
            if given is not None:
                line["sdpa_backend"] = sdpa_backend(run) if device.type == "cuda" else "cpu"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    for window in (None, WINDOW):
        for line in measure(args, window):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
