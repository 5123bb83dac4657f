"""GPT-OSS attention (with sinks) on roundpipe's copies: the eager numbers, every mask, both ways.

The reference is transformers' own eager attention function of the model's module, in fp32 on
CPU: outputs and every gradient (query, key, value, sinks) agree to float rounding, with the
masks the eager path takes (causal, sliding window, padding; additive and boolean) through the
extra sink key, and without a mask (the module's own causal or sliding mask) through flash
attention and ``sigmoid(lse - sink)``, exact in fp64. A pipe over a GPT-OSS model gives the plain
loop's losses while its copies run this function, both ways.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import roundpipe.model.sink_attention as sink_attention
import roundpipe.model.transformers_presets as transformers_presets
from roundpipe.model.sink_attention import ATTENTION_NAME, sdpa_with_sinks, use_sink_attention
from tests.test_moe_parity import accumulation_loop, padded_data, tiny_gpt_oss
from tests.test_transformers_parity import assert_same_weights, pipe_loop, tiny_qwen3, token_data

HEADS, KV_HEADS, DIM, N = 4, 2, 8, 11


def attention_module(layer: int = 0) -> Any:
    """Layer 0 slides (window 4), layer 1 attends to every earlier token."""
    module = tiny_gpt_oss(layers=2).model.layers[layer].self_attn
    with torch.no_grad():
        module.sinks.normal_(0.0, 1.0)
    return module


def eager_function(module: Any) -> Any:
    return __import__(type(module).__module__, fromlist=["x"]).eager_attention_forward


def masks() -> dict[str, torch.Tensor | None]:
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    index = torch.arange(N)
    sliding = causal & (index[:, None] - index[None, :] < 4)
    padded = causal[None].repeat(2, 1, 1)
    padded[1, :, :3] = False  # the second row's first three tokens are padding
    additive = torch.zeros(2, 1, N, N).masked_fill(~padded[:, None], torch.finfo(torch.float32).min)
    return {
        "none": None,
        "causal-bool": causal[None, None].expand(2, 1, N, N),
        "sliding-bool": sliding[None, None].expand(2, 1, N, N),
        "padded-additive": additive,
    }


def run(function: Any, module: Any, mask: torch.Tensor | None, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    where = {"device": module.sinks.device, "dtype": module.sinks.dtype}  # the module's
    heads = (
        module.config.num_attention_heads,
        module.config.num_key_value_heads,
        module.config.num_key_value_heads,
    )
    q, k, v = (torch.randn(2, h, N, module.head_dim, generator=g).to(**where).requires_grad_() for h in heads)
    module.sinks.grad = None
    out, _ = function(module, q, k, v, mask, module.scaling, 0.0, s_aux=module.sinks)
    (out * torch.linspace(-1, 1, out.numel(), **where).view(out.shape)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad, module.sinks.grad.clone()]


@pytest.mark.parametrize("mask", list(masks()))
def test_sdpa_with_sinks_is_the_eager_function(mask: str) -> None:
    module = attention_module()
    given = masks()[mask]
    if given is None:  # eager without a mask attends everywhere; sdpa_with_sinks: the module's own
        reference_mask: torch.Tensor | None = own_mask(module)
    elif given.dtype == torch.bool:  # eager adds its mask: the additive form of the same mask
        reference_mask = torch.zeros(given.shape).masked_fill(~given, torch.finfo(torch.float32).min)
    else:
        reference_mask = given
    want = run(eager_function(module), module, reference_mask)
    got = run(sdpa_with_sinks, module, given)
    for name, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        if mask == "padded-additive" and name == "output":  # fully masked rows: the sink's share only
            a, b = a[:, 3:], b[:, 3:]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def own_mask(module: Any, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The module's causal (and, on a sliding layer, windowed) mask in eager's additive form."""
    index = torch.arange(N, device=device)
    allowed = index[None, :] <= index[:, None]
    if module.sliding_window is not None:
        allowed &= index[:, None] - index[None, :] < module.sliding_window
    return torch.zeros(1, 1, N, N, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def gpt_oss_with_sinks(seed: int) -> Any:
    """A tiny GPT-OSS whose sinks matter (random, not the zeros it starts with)."""
    model = tiny_gpt_oss(seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Replace ``owner.name`` by a wrapper that counts its calls."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("layer", [0, 1])
def test_without_a_mask_flash_and_the_sink_weight_are_exact_in_fp64(
    layer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module's own mask, sliding (layer 0) or full (layer 1): flash attention's output times
    sigmoid(lse - sink), and its backward fed g * w and the sinked output, are eager's numbers to
    fp64 rounding, the sink's gradient included; no sdpa call, no mask tensor."""
    flash = counting(monkeypatch, sink_attention, "_flash_forward")
    sdpa = counting(monkeypatch, F, "scaled_dot_product_attention")
    module = attention_module(layer).double()
    want = run(eager_function(module), module, own_mask(module, torch.float64))
    got = run(sdpa_with_sinks, module, None)
    assert flash and not sdpa
    for name, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)


def test_dropout_runs_the_eager_function() -> None:
    module = attention_module()
    q, k, v = (
        torch.randn(1, HEADS, N, DIM),
        torch.randn(1, KV_HEADS, N, DIM),
        torch.randn(1, KV_HEADS, N, DIM),
    )
    torch.manual_seed(3)
    want, _ = eager_function(module)(
        module, q, k, v, own_mask(module), module.scaling, 0.5, s_aux=module.sinks
    )
    torch.manual_seed(3)
    got, _ = sdpa_with_sinks(module, q, k, v, None, module.scaling, 0.5, s_aux=module.sinks)
    torch.testing.assert_close(got, want)


def test_only_the_copies_sink_attention_changes() -> None:
    model = tiny_gpt_oss(layers=2)
    copied = copy.deepcopy(model.model.layers[0])
    assert use_sink_attention(copied) == 1
    assert copied.self_attn.config._attn_implementation == ATTENTION_NAME
    assert model.model.layers[0].self_attn.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"
    assert use_sink_attention(copy.deepcopy(tiny_qwen3().model.layers[0])) == 0  # no sinks


def test_a_pipe_over_gpt_oss_runs_sdpa_and_the_plain_loops_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch, F, "scaled_dot_product_attention")
    model = gpt_oss_with_sinks(seed=1)
    reference = copy.deepcopy(model)
    data = padded_data(2)
    expected = accumulation_loop(reference, data)
    assert not calls  # transformers' eager path never calls sdpa
    assert pipe_loop(model, data) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert calls, "the pipe's copies never ran sdpa_with_sinks"
    assert_same_weights(model, reference)
    assert all(layer.self_attn.config._attn_implementation == "eager" for layer in model.model.layers)


def test_a_pipe_over_unpadded_gpt_oss_rows_carries_no_mask_and_runs_flash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows without padding: the embed layer's copy builds no mask, every attention copy runs the
    flash way (sliding and full layers), and the losses and weights are the plain loop's."""
    flash = counting(monkeypatch, sink_attention, "_flash_forward")
    masks = counting(monkeypatch, transformers_presets, "transformers_masks")
    model = gpt_oss_with_sinks(seed=2)
    reference = copy.deepcopy(model)
    data = token_data(2)
    expected = accumulation_loop(reference, data)
    assert pipe_loop(model, data) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert flash, "the pipe's copies never ran flash attention with sinks"
    assert not masks, "the embed layer's copy built masks for unpadded rows"
    assert_same_weights(model, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [0, 1])
def test_on_cuda_without_a_mask_flash_attention_runs_it_and_agrees_with_eager_in_bf16(
    layer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's flash attention op with its sliding window (layer 0) or causal alone (layer 1):
    eager's numbers within bf16 rounding, sdpa never called; and it compiles without a graph
    break."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    module = attention_module(layer).to("cuda", torch.bfloat16)
    want = run(eager_function(module), module, own_mask(module, torch.bfloat16, "cuda"))
    flash = counting(monkeypatch, sink_attention, "_flash_forward")
    sdpa = counting(monkeypatch, F, "scaled_dot_product_attention")
    got = run(sdpa_with_sinks, module, None)
    assert flash and not sdpa
    for name, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        scale = float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * scale, msg=name)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: sdpa_with_sinks(module, q, k, v, None, module.scaling)[0], fullgraph=True
    )
    q = torch.randn(1, HEADS, N, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, N, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    compiled(q, k, v).sum().backward()
    assert q.grad is not None and module.sinks.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 4])
def test_on_cuda_a_fused_kernel_takes_it_and_agrees_with_eager_in_bf16(window: int | None) -> None:
    """With the math backend excluded, sdpa must still run it (flash or memory-efficient); the
    numbers stay those of the eager function within bf16 rounding (eager softmaxes in bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    module = attention_module().to("cuda", torch.bfloat16)
    index = torch.arange(N, device="cuda")
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed &= index[:, None] - index[None, :] < window
    mask = torch.zeros(1, 1, N, N, device="cuda", dtype=torch.bfloat16).masked_fill(
        ~allowed, torch.finfo(torch.bfloat16).min
    )
    want = run(eager_function(module), module, mask)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = run(sdpa_with_sinks, module, mask)
    for name, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        scale = float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * scale, msg=name)


def test_the_bench_runs_on_a_cpu_and_reports_every_gradient(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/sink_attention_gpu.py's smoke run: its times are left to the bench; here, that both
    functions run on both masks and the sdpa lines compare every gradient with eager's."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "sink_attention_gpu.py"
    spec = importlib.util.spec_from_file_location("sink_attention_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--device", "cpu", "--tokens", "32", "--repeats", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["mask"], x["function"]) for x in lines] == [
        (mask, function)
        for mask in ("full", "sliding")
        for function in ("eager", "sdpa_with_sinks", "flash_with_sinks")
    ]
    for line in (x for x in lines if x["function"] != "eager"):  # bf16 on both sides: rounding apart
        assert set(line["max_diff"]) == {"output", "dq", "dk", "dv", "dsinks"}
        assert line["max_diff"]["output"] <= 0.05 * line["largest_output"]
