"""The sum of a token's expert rows (`roundpipe.model.choice_sum`): the custom ops equal the torch
formula the experts used before them, forward and backward; the Triton kernels compute it (run in
Triton's interpreter on CPU where Triton is installed, and on a GPU); and a grouped MoE block with
the ops switched on gives the block's output and gradients as with them off.

The interpreter rounds fp32 to bf16 by truncation (a GPU rounds to nearest), so its bf16 results
are held to the width of a bf16 step, and its fp32 results to the order of fp32 additions."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from roundpipe.model import choice_sum
from roundpipe.model.routing import inverse_order, route, sort_choices, unsort_rows
from tests.test_moe_experts import IDS, MODELS, counted_calls, eager, mlp_pair, run_block
from tests.test_moe_parity import padded_data
from tests.test_transformers_parity import assert_same_weights, pipe_loop
from tests.test_transformers_parity import lora as qkvo_lora

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def routed(
    tokens: int, k: int, width: int, experts: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, Any]:
    """Rows in expert order for ``tokens`` tokens with ``k`` distinct choices each, their routing,
    the router's weights and a token gradient."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    routing = route(index, experts)
    return {
        "rows": torch.randn(tokens * k, width, generator=gen).to(dtype),
        "routing": routing,
        "inverse": inverse_order(routing),
        "weights": torch.rand(tokens, k, generator=gen),
        "grad": torch.randn(tokens, width, generator=gen).to(dtype),
        "k": k,
    }


def former_combine(
    rows: torch.Tensor, routing: Any, inverse: torch.Tensor, weights: torch.Tensor, k: int
) -> Any:
    """The experts' combine as `roundpipe.model.experts` wrote it in torch ops."""
    out = rows * sort_choices(weights, routing, inverse).unsqueeze(-1).to(rows.dtype)
    return unsort_rows(out, routing, inverse).view(weights.shape[0], k, -1).sum(dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_is_the_former_combine_forward_and_backward_bit_for_bit(dtype: torch.dtype) -> None:
    case = routed(tokens=9, k=4, width=24, experts=7, dtype=dtype)
    results = []
    for combine in (former_combine, None):
        rows = case["rows"].clone().requires_grad_(True)
        weights = case["weights"].clone().requires_grad_(True)
        if combine is None:
            out = choice_sum.choice_sum(rows, case["inverse"], weights, case["k"])
        else:
            out = combine(rows, case["routing"], case["inverse"], weights, case["k"])
        out.backward(case["grad"])
        results.append((out.detach(), rows.grad, weights.grad))
    for ours, theirs in zip(results[1], results[0], strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_the_unweighted_sum_is_the_gather_gradient_and_back_propagates() -> None:
    case = routed(tokens=6, k=3, width=10, experts=5, dtype=torch.float64)
    inverse, k = case["inverse"], case["k"]
    expected = case["rows"][inverse].view(6, k, -1).sum(dim=1)
    assert torch.equal(choice_sum.choice_sum(case["rows"], inverse, None, k), expected)
    rows, weights = case["rows"].clone().requires_grad_(True), case["weights"].double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r: choice_sum.choice_sum(r, inverse, None, k), (rows,))
    assert torch.autograd.gradcheck(lambda r, w: choice_sum.choice_sum(r, inverse, w, k), (rows, weights))


def test_the_ops_trace_into_one_graph_and_compute_as_eager() -> None:
    import torch._dynamo

    case = routed(tokens=8, k=2, width=16, experts=4, dtype=torch.float32)

    def loss(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(
            choice_sum.choice_sum(rows, case["inverse"], weights, case["k"])
        ).sum()

    explained = torch._dynamo.explain(loss)(case["rows"], case["weights"])
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    grads = []
    for run in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        rows, weights = (
            case["rows"].clone().requires_grad_(True),
            case["weights"].clone().requires_grad_(True),
        )
        run(rows, weights).backward()
        grads.append((rows.grad, weights.grad))
    torch._dynamo.reset()
    for ours, theirs in zip(grads[1], grads[0], strict=True):
        assert torch.equal(ours, theirs)


def interpreter_checks() -> None:
    """Every kernel against the reference, fp32 and bf16, one partial column block and two full
    blocks plus a partial one; run by `test_the_kernels_compute_the_reference` in a process of its
    own, as Triton's interpreter must be chosen before Triton is first imported."""
    for width in (40, 2100):
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6)):
            case = routed(tokens=5, k=3, width=width, experts=6, dtype=dtype, seed=width)
            rows, inverse, weights, k, grad = (case[n] for n in ("rows", "inverse", "weights", "k", "grad"))
            # A sum of k rounded terms: held to a step of the largest term's size.
            term = tolerance * k * float(rows.float().abs().max())
            for given in (weights, None):
                expected = choice_sum.reference(rows, inverse, given, k).float()
                got = choice_sum.launch_sum(rows, inverse, given, k)
                assert got.dtype == dtype, (width, dtype)
                torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=term)
            expected_rows, expected_weights = choice_sum._reference_backward(grad, rows, inverse, weights, k)
            got_rows, got_weights = choice_sum.launch_backward(grad, rows, inverse, weights, k)
            torch.testing.assert_close(
                got_rows.float(), expected_rows.float(), rtol=tolerance, atol=tolerance
            )
            # A dot product of ``width`` rounded products, each of whose roundings may differ.
            scale = tolerance * float((grad.float().abs() @ rows.float().abs().T).max())
            torch.testing.assert_close(got_weights, expected_weights, rtol=tolerance, atol=scale)
    # The ops themselves with the kernels chosen (the CUDA path of their bodies), forward and backward.
    choice_sum._kernels_here = lambda t: True  # type: ignore[assignment]
    case = routed(tokens=5, k=3, width=40, experts=6, dtype=torch.float32, seed=3)
    rows, weights = case["rows"].clone().requires_grad_(True), case["weights"].clone().requires_grad_(True)
    out = choice_sum.choice_sum(rows, case["inverse"], weights, case["k"])
    out.backward(case["grad"])
    expected_rows, expected_weights = choice_sum._reference_backward(
        case["grad"], case["rows"], case["inverse"], case["weights"], case["k"]
    )
    expected = choice_sum.reference(case["rows"], case["inverse"], case["weights"], case["k"])
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows.grad, expected_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.grad, expected_weights, rtol=1e-5, atol=1e-5)
    print("kernels checked")


@needs_triton
def test_the_kernels_compute_the_reference() -> None:
    code = "import tests.test_choice_sum as checks; checks.interpreter_checks()"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "kernels checked" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not choice_sum.available(), reason="needs Triton and CUDA")
def test_the_kernels_on_cuda_round_as_the_reference() -> None:
    case = routed(tokens=300, k=8, width=2048, experts=128, dtype=torch.bfloat16)
    rows, inverse, weights, grad = (case[n].cuda() for n in ("rows", "inverse", "weights", "grad"))
    expected = choice_sum.reference(rows, inverse, weights, 8)
    got = choice_sum.launch_sum(rows, inverse, weights, 8)
    assert (got.float() - expected.float()).abs().max() <= 2**-7 * expected.float().abs().max()
    expected_rows, expected_weights = choice_sum._reference_backward(grad, rows, inverse, weights, 8)
    got_rows, got_weights = choice_sum.launch_backward(grad, rows, inverse, weights, 8)
    assert torch.equal(got_rows, expected_rows)
    assert torch.allclose(got_weights, expected_weights, rtol=1e-2, atol=1e-1)


@pytest.mark.gpu
@pytest.mark.skipif(not choice_sum.available(), reason="needs Triton and CUDA")
@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python-wrapper", "cpp-wrapper"])
def test_inductor_launches_the_kernels_itself_on_cuda(cpp_wrapper: bool) -> None:
    """Compiled, the ops' kernels are launched from inductor's code, not called back as ops."""
    import torch._dynamo
    import torch._inductor.config
    from torch._inductor.utils import run_and_get_code

    case = routed(tokens=300, k=8, width=2048, experts=128, dtype=torch.bfloat16)
    rows, inverse, weights, grad = (case[n].cuda() for n in ("rows", "inverse", "weights", "grad"))

    def step(rows: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = choice_sum.choice_sum(rows, inverse, weights, 8) * 2
        return (out, *torch.autograd.grad(out, (rows, weights), grad))

    inputs = (rows.clone().requires_grad_(True), weights.clone().requires_grad_(True))
    expected = step(*inputs)
    torch._dynamo.reset()
    with torch._inductor.config.patch(cpp_wrapper=cpp_wrapper):
        got, code = run_and_get_code(torch.compile(step), *inputs)
    torch._dynamo.reset()
    text = "\n".join(code)
    assert "_sum_kernel" in text and "roundpipe.choice_sum" not in text
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_a_grouped_block_with_the_ops_is_the_block_without(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output, input gradient and every parameter's gradient (the router's through the weights)."""
    _, grouped = mlp_pair(make)
    hidden = grouped.experts.gate_up_proj.shape[2 if type(grouped).__name__.startswith("Qwen") else 1]
    x = torch.randn(3, 11, hidden, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(3, 11, hidden, generator=torch.Generator().manual_seed(2))
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(choice_sum, "ENABLED", enabled)
        grouped.zero_grad(set_to_none=True)
        out, dx = run_block(grouped, x, weight)
        results.append([out, dx, *(p.grad for p in grouped.parameters())])
    assert len(results[0]) > 3
    for ours, theirs in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python-wrapper", "cpp-wrapper"])
def test_a_block_compiled_by_inductor_goes_through_the_ops_and_computes_the_same(
    cpp_wrapper: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under both of inductor's wrappers (roundpipe compiles layers with the C++ one on CUDA) the
    block's graph is built through the ops: on CPU their bodies, the torch formula, trace into it."""
    import torch._dynamo
    import torch._inductor.config

    _, grouped = mlp_pair(MODELS[0])
    x = torch.randn(3, 11, grouped.experts.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(1))
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    eager = run_block(grouped, x, weight)
    monkeypatch.setattr(choice_sum, "ENABLED", True)
    sums = counted_calls(monkeypatch, choice_sum, "reference")
    backwards = counted_calls(monkeypatch, choice_sum, "_reference_backward")
    torch._dynamo.reset()
    with torch._inductor.config.patch(cpp_wrapper=cpp_wrapper):
        compiled = run_block(torch.compile(grouped), x, weight)
    torch._dynamo.reset()
    assert sums and backwards, (len(sums), len(backwards))
    for ours, theirs in zip(compiled, eager, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_a_pipe_with_the_ops_trains_as_without(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA on q/k/v/o with the router loss, through the stages, their recomputes and the optimizer:
    the same losses and weights with the ops on as off (on CPU they compute the torch formula)."""
    data = padded_data(2)
    runs = []
    for enabled in (False, True):
        monkeypatch.setattr(choice_sum, "ENABLED", enabled)
        calls = counted_calls(monkeypatch, choice_sum, "reference")
        model = qkvo_lora(eager(make(router_logits=True)))
        runs.append((pipe_loop(model, data), model, bool(calls)))
    assert runs[0][2] is False and runs[1][2] is True
    assert runs[1][0] == runs[0][0]
    assert_same_weights(runs[1][1], runs[0][1])


def test_by_default_the_ops_are_used_where_their_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ENABLED`` None: a CPU tensor takes the torch formula inline, a tensor the kernels can take
    (CUDA, Triton) the ops; True and False force either."""
    rows = torch.zeros(4, 3)
    assert choice_sum.ENABLED is None
    assert choice_sum.in_use(rows) is False
    monkeypatch.setattr(choice_sum, "_kernels_here", lambda t: t is rows)
    assert choice_sum.in_use(rows) is True
    assert choice_sum.in_use(torch.zeros(1)) is False
    monkeypatch.setattr(choice_sum, "ENABLED", False)
    assert choice_sum.in_use(rows) is False
    monkeypatch.setattr(choice_sum, "ENABLED", True)
    assert choice_sum.in_use(torch.zeros(1)) is True
