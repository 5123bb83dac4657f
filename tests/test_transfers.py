"""Parameter chunks cut tensors by byte range, and gradients download in chunks: every element
travels exactly once, and training with tiny chunks is exactly the plain loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.backends.tensors import (
    chunk_spans,
    download_fp32,
    element_span,
    gradient_chunk_elements,
    part_range,
)
from tests.helpers import assert_weights_equal, batches, mlp, sync_reference, train_steps

mse = nn.functional.mse_loss


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 64])
def test_every_element_belongs_to_exactly_one_chunk(parts: int) -> None:
    tensors = [(17, 4), (5, 2), (1, 8), (33, 4)]  # (elements, element size): odd sizes, mixed widths
    total = sum(n * size for n, size in tensors)
    covered = [[0] * n for n, _ in tensors]
    sizes = []
    expected: list[list[tuple[int, int, int]]] = []  # per chunk, the tensors it touches
    for part in range(parts):
        low, high = part_range(total, part, parts)
        sizes.append(high - low)
        offset, touched = 0, []
        for index, (n, size) in enumerate(tensors):
            first, last = element_span(offset, n * size, size, low, high)
            for element in range(first, last):
                covered[index][element] += 1
            if first < last:
                touched.append((index, first, last))
            offset += n * size
        expected.append(touched)
    assert all(count == 1 for row in covered for count in row)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    # The spans the runtime keeps per layer are the same, with the tensors no chunk touches left out.
    assert chunk_spans([(n * size, size) for n, size in tensors], parts) == expected


def test_gradients_download_in_chunks() -> None:
    source = torch.randn(7, 5, dtype=torch.bfloat16)
    landing = torch.full((7, 5), float("nan"))
    download_fp32(source, landing, chunk_elements=4)
    assert torch.equal(landing, source.to(torch.float32))


def test_gradients_convert_64_mib_at_a_time_whatever_the_upload_pieces() -> None:
    """Weights upload in 256 MiB pieces by default; the fp32 conversion of a gradient on the
    device, which the memory model leaves out, stays at 64 MiB (smaller pieces make it smaller)."""
    assert roundpipe.RunConfig().chunk_bytes == 256 << 20
    assert gradient_chunk_elements(256 << 20) == gradient_chunk_elements(None) == (64 << 20) // 4
    assert gradient_chunk_elements(1 << 20) == (1 << 20) // 4 and gradient_chunk_elements(3) == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_training_with_tiny_chunks_matches_the_plain_loop() -> None:
    def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    data = batches(3)
    _, ref_weights = sync_reference(mlp(), sgd, data, mse)
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=4, async_optimizer=False, chunk_bytes=100)
    with roundpipe.RoundPipe(mlp(), optimizer=sgd, config=config) as pipe:
        weights = train_steps(pipe, data, mse)
        uploads = [t for t in pipe.trace() if t.kind == "param_up"]
    assert max(t.num_parts for t in uploads) > 1  # the weights really travelled in pieces
    for got, want in zip(weights, ref_weights, strict=True):
        assert_weights_equal(got, want, rtol=1e-5, atol=1e-6)


def test_fresh_leaves_are_freed_without_a_garbage_collection() -> None:
    """The stage input's leaves (and the input gradient they receive) go as soon as nothing uses
    them: a reference cycle here kept every one on the device until a full collection."""
    import gc
    import weakref

    from roundpipe.backends.tensors import with_leaves

    gc.disable()
    try:
        rebuilt, leaves = with_leaves({"hidden": torch.randn(2, 3), "_cos": torch.randn(3)})
        leaf = leaves[0]
        assert leaf is not None and leaf.requires_grad and rebuilt["hidden"] is leaf
        alive = weakref.ref(leaf)
        del rebuilt, leaves, leaf
        assert alive() is None
    finally:
        gc.enable()
