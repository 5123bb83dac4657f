"""The shape of a run: how many devices, how many microbatches, and how the loop submits them.

Why it exists: the planner, its evaluators, the replay and the simulation all describe the run
they plan or time by the same handful of numbers (devices, microbatches per iteration, round size,
async optimizer, how late the loop reads its losses). Passed one by one they drift (an argument
added to one function and forgotten in the next) and crowd every signature; one frozen value
keeps them together and is hashable, so caches can key on it. It must never hold costs, a plan or
anything that changes during a run: only the shape the run was configured with.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.plan.rounds import round_sizes


@dataclass(frozen=True)
class RunShape:
    """A run's shape. ``round_size``: microbatches per round (None: `round_sizes`' default);
    ``loss_lag``: iterations a training loop reads each loss late (0 or 1, async runs)."""

    num_devices: int
    num_microbatches: int
    async_optimizer: bool = False
    round_size: int | None = None
    loss_lag: int = 0

    def rounds(self) -> tuple[int, ...]:
        """The microbatches of each round (`round_sizes`)."""
        return round_sizes(self.num_microbatches, self.num_devices, self.round_size)
