"""A decoder layer's MLP sliced over long sequences: the same numbers, less saved, users untouched."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from roundpipe.backends import compiling
from roundpipe.model import chunked_mlp
from roundpipe.model.chunked_mlp import chunk_long_sequences
from tests.test_transformers_parity import (
    assert_same_weights,
    pipe_loop,
    reference_loop,
    tiny_qwen3,
    token_data,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Slices of 8 tokens from 16 tokens per call on; records each checkpointed slice's rows."""
    monkeypatch.setattr(chunked_mlp, "CHUNK_TOKENS", 8)
    monkeypatch.setattr(chunked_mlp, "MIN_TOKENS", 16)
    rows: list[int] = []
    real = chunked_mlp.checkpoint

    def spy(fn: Any, part: torch.Tensor, *params: Any, **kwargs: Any) -> Any:
        rows.append(part.shape[0])
        return real(fn, part, *params, **kwargs)

    monkeypatch.setattr(chunked_mlp, "checkpoint", spy)
    return rows


def _saved_bytes(fn: Any, module: torch.nn.Module) -> int:
    """Bytes of the activations autograd saves (parameters, saved too, are not counted)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_sliced_mlp_equals_the_original(small_slices: list[int]) -> None:
    mlp = tiny_qwen3().model.layers[0].mlp
    chunked = chunk_long_sequences(copy.deepcopy(mlp))
    assert chunked.state_dict().keys() == mlp.state_dict().keys()
    torch.manual_seed(0)
    x = torch.randn(2, 20, mlp.gate_proj.in_features, requires_grad=True)
    grad = torch.randn(2, 20, mlp.down_proj.out_features)
    results = []
    for module in (mlp, chunked):
        x.grad = None
        module.zero_grad()
        out = module(x)
        out.backward(grad)
        results.append((out.detach(), x.grad.clone(), module.gate_proj.weight.grad.clone()))
    assert small_slices == [8, 8, 8, 8, 8]  # 40 tokens, slices of 8
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(chunked(x), mlp(x), rtol=1e-6, atol=1e-6)
    short = x[:, :5]  # 10 tokens: the original forward
    torch.testing.assert_close(chunked(short), mlp(short))
    assert len(small_slices) == 5
    # What autograd keeps: the slices' inputs (views of x) instead of the MLP's intermediates.
    assert _saved_bytes(lambda: chunked(x), chunked) < _saved_bytes(lambda: mlp(x), mlp) / 3


def trains_like_the_plain_loop(
    make: Callable[[], Any],
    data: list[dict[str, torch.Tensor]],
    slices: list[int],
    compiled: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> Any:
    """A model from ``make`` trained on ``data`` through the pipe, its layers compiled or not
    (dynamo's capture, its "eager" backend): it sliced, and has the losses and weights of the
    plain loop on a copy. Returns the trained model."""
    torch._dynamo.reset()
    monkeypatch.setitem(compiling.DEFAULT_OPTIONS, "backend", "eager")
    model = make()
    reference = copy.deepcopy(model)
    expected = reference_loop(reference, data)
    losses = pipe_loop(model, data, compile=compiled)
    assert slices, "the replicas did not slice"
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_through_sliced_replicas_equals_the_plain_loop(
    small_slices: list[int], compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the layers compiled: the slicing is a graph break for long inputs only."""
    data = token_data(2, batch=4, seq=16)  # 32 tokens per microbatch of 2 rows: sliced
    model = trains_like_the_plain_loop(tiny_qwen3, data, small_slices, compiled, monkeypatch)
    # The user's model keeps its own classes.
    assert all(type(layer.mlp).__name__ == "Qwen3MLP" for layer in model.model.layers)
