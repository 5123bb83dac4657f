"""One MoE block of workload D on a GPU: transformers' eager experts against roundpipe's grouped ones.

A Qwen3-30B-A3B sparse MoE block (hidden 2048, 128 experts of width 768, 8 per token), random
weights in bf16, ``--tokens`` tokens (default 4096), frozen experts as under LoRA (the input
gradient only) or ``--train-experts``. For each implementation it times forward and backward
(CUDA events, median of ``--repeats`` after warm-up), reads the peak memory above the weights,
counts the host synchronisations of one call (`torch.cuda.set_sync_debug_mode("warn")` warnings)
and prints one JSON line; the grouped lines carry their largest difference to the eager output.
With frozen experts two more lines run the grouped block on experts held in NF4
(`roundpipe.model.experts.quantize_experts_`): dequantized per product in eager torch
(``roundpipe_grouped_nf4``) and with the compiled kernel (``roundpipe_grouped_nf4_compiled``);
their difference is to the grouped block on the dequantized weights (the quantization error
excluded), and ``expert_weight_bytes`` says what the experts hold on the device.
Run on the GPU machine: ``python bench/moe_experts_gpu.py`` (about a minute).

``--permutations`` times instead the grouped block's permutations both ways, eager and under
``torch.compile`` (as roundpipe runs a layer): with their gradients as gathers
(`roundpipe.model.routing`, the default) and with autograd's gradient of indexing (a scatter with
accumulation, ``impl`` ending in ``_indexed``); each line carries its largest input-gradient
difference to the first.

``--unread`` times the grouped block, eager and compiled, as a recompute whose output nothing
reads (`roundpipe.model.experts_tail`: no down products, no sum of the choices) against the full
block; each line carries its largest input-gradient difference to the full block's.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from gpu_kernels import timed

import roundpipe.model.experts as experts_module
from roundpipe.model import choice_sum
from roundpipe.model.experts import dequantized_experts, quantize_experts_, use_grouped_experts


def block(args: argparse.Namespace) -> Any:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    mlp = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 0.02)
    mlp = mlp.to("cuda", torch.bfloat16)
    for name, param in mlp.named_parameters():
        param.requires_grad_(args.train_experts or "experts" not in name)
    return mlp


def step(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output on ``x`` and the input's gradient, of ones back-propagated."""
    x = x.detach().requires_grad_(True)
    out = mlp(x)
    out.backward(torch.ones_like(out))
    assert x.grad is not None
    return out.detach(), x.grad


def measure(
    name: str, mlp: Any, x: torch.Tensor, repeats: int
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """The line of timings, and the output and input gradient of the warm-up call."""
    out, dx = step(mlp, x)  # warm-up: kernels, workspaces
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(mlp, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(mlp, x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    line = {"bench": "moe_block", "impl": name, "tokens": x.shape[1], "fwd_bwd_ms": statistics.median(times)}
    return line | {"peak_above_weights_bytes": peak, "host_syncs": syncs}, out, dx


def indexed_gather(hidden: torch.Tensor, routing: Any, inverse: torch.Tensor, k: int) -> torch.Tensor:
    return hidden[routing.token]


def indexed_unsort(rows: torch.Tensor, routing: Any, inverse: torch.Tensor) -> torch.Tensor:
    return rows[inverse]


def indexed_sort_choices(values: torch.Tensor, routing: Any, inverse: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1)[routing.order]


PERMUTATIONS = ("gather_rows", "unsort_rows", "sort_choices")


def compiled_line(
    grouped: Any, x: torch.Tensor, repeats: int, compiled: bool, suffix: str
) -> tuple[dict[str, Any], torch.Tensor]:
    """The grouped block's line, eager or freshly compiled, and its input gradient in fp32."""
    torch._dynamo.reset()
    mlp = torch.compile(grouped) if compiled else grouped
    line, _, dx = measure("roundpipe_grouped" + ("_compiled" if compiled else "") + suffix, mlp, x, repeats)
    return line, dx.float()


def permutations(grouped: Any, x: torch.Tensor, repeats: int) -> None:
    """The grouped block with gathers as its permutations' gradients against autograd's indexing,
    eager and compiled (module docstring)."""
    gathers = [getattr(experts_module, name) for name in PERMUTATIONS]
    indexing = (indexed_gather, indexed_unsort, indexed_sort_choices)
    reference: torch.Tensor | None = None
    for compiled in (False, True):
        for indexed in (False, True):
            for name, function in zip(PERMUTATIONS, indexing if indexed else gathers, strict=True):
                setattr(experts_module, name, function)
            line, grad = compiled_line(grouped, x, repeats, compiled, "_indexed" if indexed else "")
            reference = grad if reference is None else reference
            line["max_abs_dx_diff_to_first"] = float((grad - reference).abs().max())
            print(json.dumps(line), flush=True)
    for name, function in zip(PERMUTATIONS, gathers, strict=True):
        setattr(experts_module, name, function)


def switched_lines(
    grouped: Any, x: torch.Tensor, repeats: int, switch: Callable[[bool], None], suffix: str, diff_key: str
) -> None:
    """The grouped block with ``switch(False)`` then ``switch(True)``, eager and compiled; each
    line carries its largest input-gradient difference to the switched-off line (``diff_key``)."""
    for compiled in (False, True):
        reference: torch.Tensor | None = None
        for on in (False, True):
            switch(on)
            line, grad = compiled_line(grouped, x, repeats, compiled, suffix if on else "")
            reference = grad if reference is None else reference
            line[diff_key] = float((grad - reference).abs().max())
            line["dx_abs_max"] = float(reference.abs().max())
            print(json.dumps(line), flush=True)
    switch(False)


def unread(grouped: Any, x: torch.Tensor, repeats: int) -> None:
    """The grouped block with its output unread against the full block, eager and compiled."""

    def switch(skip: bool) -> None:
        grouped.experts.output_unread = skip  # what `frozen_tail.unread_tail` sets on a marked copy

    switched_lines(grouped, x, repeats, switch, "_unread", "max_abs_dx_diff_to_full")


def choice_sums(grouped: Any, x: torch.Tensor, repeats: int) -> None:
    """The grouped block with its choices summed by the Triton kernels (`roundpipe.model.choice_sum`)
    against inductor's fused torch ops, eager and compiled; then the sum alone at the block's size,
    its forward and its backward, the kernel against the compiled torch formula."""

    def switch(enabled: bool) -> None:
        choice_sum.ENABLED = enabled

    switched_lines(grouped, x, repeats, switch, "_choice_sum", "max_abs_dx_diff_to_torch")
    k, width = 8, x.shape[-1]
    tokens = x.numel() // width
    rows = torch.randn(tokens * k, width, device="cuda", dtype=torch.bfloat16)
    inverse = torch.randperm(tokens * k, device="cuda")
    weights = torch.rand(tokens, k, device="cuda")
    grad = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    formula = torch.compile(choice_sum.reference)
    backward = torch.compile(choice_sum._reference_backward)
    runs = {
        "sum_torch_compiled": lambda: formula(rows, inverse, weights, k),
        "sum_kernel": lambda: choice_sum.launch_sum(rows, inverse, weights, k),
        "gather_sum_torch_compiled": lambda: formula(rows, inverse, None, k),
        "gather_sum_kernel": lambda: choice_sum.launch_sum(rows, inverse, None, k),
        "sum_backward_torch_compiled": lambda: backward(grad, rows, inverse, weights, k),
        "sum_backward_kernel": lambda: choice_sum.launch_backward(grad, rows, inverse, weights, k),
    }
    for name, run in runs.items():
        moved = rows.numel() * 2 * (2 if "backward" in name else 1) + grad.numel() * 2
        ms = timed(run, repeat=repeats)
        print(
            json.dumps({"bench": "choice_sum", "impl": name, "ms": ms, "gb_per_s": moved / ms / 1e6}),
            flush=True,
        )
    got, want = choice_sum.launch_sum(rows, inverse, weights, k), formula(rows, inverse, weights, k)
    print(
        json.dumps({"bench": "choice_sum", "max_abs_diff": float((got.float() - want.float()).abs().max())})
    )


def expert_bytes(mlp: Any) -> int:
    return sum(p.numel() * p.element_size() for n, p in mlp.named_parameters() if "experts." in n)


def nf4_pair(grouped: Any) -> tuple[Any, Any]:
    """The grouped block with its experts in NF4, and a grouped block on the dequantized weights."""
    quantized = copy.deepcopy(grouped)
    assert quantize_experts_(quantized.experts, 64)
    dense = copy.deepcopy(grouped)
    with torch.no_grad():
        for name, weight in dequantized_experts(quantized.experts).items():
            getattr(dense.experts, name).copy_(weight)
    return quantized, dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--train-experts", action="store_true")
    parser.add_argument("--permutations", action="store_true", help="the permutations' A/B only")
    parser.add_argument("--unread", action="store_true", help="the unread output's A/B only")
    parser.add_argument("--choice-sum", action="store_true", help="the Triton choice sums' A/B only")
    args = parser.parse_args()
    eager = block(args)
    grouped = copy.deepcopy(eager)
    assert use_grouped_experts(grouped) == 1
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens, 2048, device="cuda", dtype=torch.bfloat16)
    if args.permutations:
        permutations(grouped, x, args.repeats)
        return
    if args.unread:
        unread(grouped, x, args.repeats)
        return
    if args.choice_sum:
        choice_sums(grouped, x, args.repeats)
        return
    reference: torch.Tensor | None = None
    for name, mlp in (("eager", eager), ("roundpipe_grouped", grouped)):
        line, out, _ = measure(name, mlp, x, args.repeats)
        if reference is None:
            reference = out.float()
        else:
            line["max_abs_diff_to_eager"] = float((out.float() - reference).abs().max())
            line["ref_abs_max"] = float(reference.abs().max())
        line["train_experts"] = args.train_experts
        line["expert_weight_bytes"] = expert_bytes(mlp)
        print(json.dumps(line), flush=True)
    if args.train_experts:
        return
    del eager
    quantized, dense = nf4_pair(grouped)
    del grouped
    _, dense_out, _ = measure("roundpipe_grouped_dequantized", dense, x, 1)
    del dense
    for name, compiled in (("roundpipe_grouped_nf4", False), ("roundpipe_grouped_nf4_compiled", True)):
        quantized.experts.compiled = compiled
        line, out, _ = measure(name, quantized, x, args.repeats)
        line["max_abs_diff_to_dequantized"] = float((out.float() - dense_out.float()).abs().max())
        line["max_abs_diff_to_eager"] = (
            float((out.float() - reference).abs().max()) if reference is not None else None
        )
        line["train_experts"] = False
        line["expert_weight_bytes"] = expert_bytes(quantized)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
