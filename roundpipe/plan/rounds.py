"""Rounds: how an iteration's microbatches split into rounds, and the count check planners share.

It exists below both `roundpipe.plan.partition` and `roundpipe.plan.dispatch`: the partition's
steady-state search needs the round sizes, and dispatch builds on `Plan`, so the round sizes (and
the positive-count check both use) live here and the two modules import it, never each other. It
must never know a plan, a slot or a cost: only counts.
"""

from __future__ import annotations

from roundpipe.errors import PlanError


def as_count(what: str, value: object, hint: str) -> int:
    """``value`` as an integer >= 1, or a `PlanError` naming ``what`` and how to fix it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{what} must be an integer >= 1, got {value!r}: {hint}")
    return value


def positive_count(what: str, value: object) -> int:
    """`as_count` with the generic hint, for arguments that only need to be positive."""
    return as_count(what, value, f"pass a positive {what}")


def round_sizes(num_microbatches: int, num_devices: int, round_size: int | None = None) -> tuple[int, ...]:
    """Microbatches per round, in order; they sum to ``num_microbatches``.

    Default: one round of all M when M < 2N, else rounds of N (host memory for stage-boundary
    activations grows with the round, not the iteration). With ``round_size`` given, rounds of
    that size. A last round that would be smaller than N is merged into the one before (a round
    under N microbatches stalls: slot i+N needs its device before slot i is done); when M < N the
    only round is all M, the best there is.
    """
    m = positive_count("num_microbatches", num_microbatches)
    n = positive_count("num_devices", num_devices)
    if round_size is None:
        size = m if m < 2 * n else n
    else:
        size = positive_count("round_size", round_size)
        if size < n:
            raise PlanError(
                f"round_size {size} is smaller than num_devices {n}: a round must hold M_R >= N "
                f"microbatches, because slot i+N of a round runs on the device that runs slot i and "
                f"must wait for all of slot i's microbatches; use round_size >= {n} (or None for the default)"
            )
    full, rest = divmod(m, size)
    if full == 0:
        return (m,)
    rounds = [size] * full
    if rest >= n:
        rounds.append(rest)
    else:
        rounds[-1] += rest
    return tuple(rounds)
