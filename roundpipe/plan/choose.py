"""Which plan a run uses: one entry point for the pipe, the CLI and the benchmarks.

`partition` answers two precise questions: the exact optimum of the t_max objective (fast, any
size), and with ``steady=True`` the best plan under the steady-state model of async round-robin
dispatch (slower: tens of milliseconds at 100 layers, seconds at 1000). For an asynchronous run
the steady state is what matters, but neither answer wins everywhere, so `choose_plan` builds both
(the steady one only where it stays cheap) and keeps the one whose modelled steady iteration is
shorter. A synchronous run fills and drains every step, which the t_max objective already counts.

Pure: no torch, no devices.
"""

from __future__ import annotations

from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import steady_iteration_ms
from roundpipe.plan.partition import Plan, partition

STEADY_SEARCH_MAX_LAYERS = 256
"""Above this the steady-state search costs more than a second; the t_max objective decides."""


def choose_plan(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    mem_limit_bytes: int | None = None,
    *,
    async_optimizer: bool = False,
    round_size: int | None = None,
) -> Plan:
    """The plan to run: `partition`'s objective optimum, or for an async run the better of it and
    the steady-state plan by `steady_iteration_ms` (ties keep the objective optimum)."""
    plan = partition(costs, num_devices, num_microbatches, mem_limit_bytes, async_optimizer=async_optimizer)
    if not async_optimizer or costs.num_layers > STEADY_SEARCH_MAX_LAYERS:
        return plan
    steady = partition(
        costs,
        num_devices,
        num_microbatches,
        mem_limit_bytes,
        async_optimizer=True,
        steady=True,
        round_size=round_size,
    )
    if steady == plan:
        return plan
    period = steady_iteration_ms(plan, num_microbatches, num_devices, round_size=round_size)
    steady_period = steady_iteration_ms(steady, num_microbatches, num_devices, round_size=round_size)
    return steady if steady_period < period else plan
