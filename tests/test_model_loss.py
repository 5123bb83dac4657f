"""chunked_cross_entropy equals F.cross_entropy on full logits and never holds more than a chunk."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from roundpipe.errors import ModelError
from roundpipe.model import chunked_cross_entropy
from roundpipe.model.loss import chunked_module_cross_entropy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(n: int = 37, h: int = 8, v: int = 11, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    return hidden, weight, bias, labels


def _grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_full_cross_entropy(chunk: int, with_bias: bool) -> None:
    hidden, weight, bias, labels = _data()
    b = bias if with_bias else None
    want = F.cross_entropy(F.linear(hidden, weight, b), labels, ignore_index=-100)
    got = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=chunk, bias=b)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    params = (hidden, weight, bias) if with_bias else (hidden, weight)
    for g, w in zip(_grads(got, *params), _grads(want, *params), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_custom_ignore_index_and_upstream_grad() -> None:
    hidden, weight, _, labels = _data(n=20)
    labels[labels == -100] = 3
    labels[:5] = 7
    want = F.cross_entropy(hidden @ weight.T, labels, ignore_index=7) * 2.5
    got = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=3, ignore_index=7) * 2.5
    torch.testing.assert_close(got, want)
    for g, w in zip(_grads(got, hidden, weight), _grads(want, hidden, weight), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_frozen_weight_gets_no_grad_and_hidden_still_does() -> None:
    hidden, weight, _, labels = _data()
    frozen = weight.detach()
    loss = chunked_cross_entropy(hidden, frozen, labels, chunk_tokens=4)
    loss.backward()
    assert frozen.grad is None and hidden.grad is not None


def test_never_materialises_more_than_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, weight, bias, labels = _data(n=50, v=13)
    rows: list[int] = []
    real_linear = F.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
        out = real_linear(x, w, b)
        rows.append(out.shape[0])
        return out

    monkeypatch.setattr(F, "linear", spy)
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=8, bias=bias)
    forward_calls = len(rows)
    loss.backward()
    # 50 tokens / 8 per chunk, each chunk's logits once: the gradient was computed with them
    assert forward_calls == 7 and len(rows) == 7
    assert max(rows) <= 8


def test_gradients_are_computed_only_when_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad, or with nothing requiring grad, the forward does no gradient products."""
    hidden, weight, _, labels = _data(n=20, v=13)
    products: list[str] = []
    real_mm = torch.mm

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        products.append("mm")
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", spy)
    with torch.no_grad():
        chunked_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    chunked_cross_entropy(hidden.detach(), weight.detach(), labels, chunk_tokens=8)
    assert products == []
    chunked_cross_entropy(hidden, weight.detach(), labels, chunk_tokens=8)
    assert products == ["mm"] * 3


def test_compiled_kernel_equals_eager() -> None:
    """The kernel `torch.compile` fuses on CUDA is the same function; here it runs eagerly and
    is checked against the unfused formula (the compiled path itself is a GPU test)."""
    from roundpipe.model.loss import softmax_cross_entropy_grad

    torch.manual_seed(3)
    logits = torch.randn(6, 9)
    labels = torch.tensor([0, 8, 3, 3, 1, 5])
    weights = torch.tensor([0.5, 0.0, 0.25, 0.25, 1.0, 0.5])
    loss, grad = softmax_cross_entropy_grad(logits, labels, weights)
    z = logits.clone().requires_grad_(True)
    want = (weights * F.cross_entropy(z, labels, reduction="none")).sum()
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    assert z.grad is not None
    torch.testing.assert_close(grad, z.grad)


def test_all_ignored_gives_zero_loss_and_zero_grads() -> None:
    hidden, weight, _, labels = _data()
    labels[:] = -100
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    assert loss.item() == 0.0
    gh, gw = _grads(loss, hidden, weight)
    assert not gh.any() and not gw.any()


def test_module_fallback_matches() -> None:
    hidden, weight, bias, labels = _data()
    head = torch.nn.Linear(8, 11)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    want = F.cross_entropy(head(hidden), labels)
    got = chunked_module_cross_entropy(hidden, head, labels, chunk_tokens=6)
    torch.testing.assert_close(got, want)
    params = (hidden, head.weight, head.bias)
    for g, w in zip(_grads(got, *params), _grads(want, *params), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_bad_arguments() -> None:
    hidden, weight, _, labels = _data()
    with pytest.raises(ModelError, match=r"\[tokens, hidden_size\]"):
        chunked_cross_entropy(hidden[None], weight, labels)
    with pytest.raises(ModelError, match="labels of shape"):
        chunked_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ModelError, match="chunk_tokens"):
        chunked_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ModelError, match="weight must be"):
        chunked_cross_entropy(hidden, weight[:, :3], labels)
    bad = labels.clone()
    bad[1] = 11
    with pytest.raises(ModelError, match="outside the vocabulary"):
        chunked_cross_entropy(hidden, weight, bad)
