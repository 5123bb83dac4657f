"""Built-in cost profiles of well-known model shapes, for `roundpipe plan` and `simulate`.

Planning and simulating need per-layer costs; these let a newcomer try the schedule of a
realistic model without writing a costs file. They are rough estimates from FLOP counts, not
measurements, and say so. Pure data: no torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.plan.costs import LayerCosts


@dataclass(frozen=True)
class Example:
    """A model described by its layer costs: embedding, ``blocks`` equal decoder layers, LM head.

    Times are milliseconds per microbatch of 4096 tokens in bf16 on one RTX 4090-class GPU
    (rough estimates from FLOP counts, not measurements); memory is the layer's bf16 weights.
    """

    description: str
    blocks: int
    block_fwd_ms: float
    block_mem_bytes: int
    embed_fwd_ms: float
    embed_mem_bytes: int
    head_factor: float  # LM head (+ final norm + loss) cost relative to one decoder layer
    head_mem_bytes: int

    def costs(self) -> LayerCosts:
        fwd = [self.embed_fwd_ms, *[self.block_fwd_ms] * self.blocks, self.block_fwd_ms * self.head_factor]
        mem = [self.embed_mem_bytes, *[self.block_mem_bytes] * self.blocks, self.head_mem_bytes]
        names = ["embed", *[f"layers.{i}" for i in range(self.blocks)], "head"]
        return LayerCosts(tuple(fwd), tuple(2.0 * x for x in fwd), tuple(mem), tuple(names))


EXAMPLES: dict[str, Example] = {
    "qwen3-1.7b": Example(
        "Qwen3-1.7B: 28 decoder layers, tied 152k-token embedding and LM head",
        blocks=28,
        block_fwd_ms=4.0,
        block_mem_bytes=100_663_296,
        embed_fwd_ms=0.15,
        embed_mem_bytes=622_329_856,
        head_factor=3.5,
        head_mem_bytes=622_329_856,
    ),
    "llama-8b": Example(
        "Llama-3-8B: 32 decoder layers, 128k-token embedding and LM head",
        blocks=32,
        block_fwd_ms=14.0,
        block_mem_bytes=436_207_616,
        embed_fwd_ms=0.3,
        embed_mem_bytes=1_050_673_152,
        head_factor=2.5,
        head_mem_bytes=1_050_673_152,
    ),
    "tiny": Example(
        "a tiny 8-layer model for quick experiments",
        blocks=8,
        block_fwd_ms=1.0,
        block_mem_bytes=8_388_608,
        embed_fwd_ms=0.1,
        embed_mem_bytes=4_194_304,
        head_factor=2.0,
        head_mem_bytes=4_194_304,
    ),
}
