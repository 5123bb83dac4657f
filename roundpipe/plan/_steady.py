"""The max-plus model of the asynchronous steady state: iteration time of an endless round-robin stream.

With the asynchronous optimizer, iterations chain without a flush, so what costs time is not the
fill and drain but how the round-robin stream of stage runs paces itself. Run k of the stream
(slot k mod S of its round) goes to device k mod N; its first microbatch waits for the same
microbatch of run k-1 (same round), its device is busy with run k-N for that run's M_R stage
times, and at most one stage is prefetched, so it also waits for the last microbatch of run k-2N.
That is a max-plus linear system; its throughput is the largest cycle ratio of the graph below
(weights in ms, transits in iterations), found exactly by policy iteration (Howard's algorithm).

It exists apart from the t_max search so that each stays small; it works on plain numbers only and
must never build plans or import torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from roundpipe.plan import native

Arcs = list[list[tuple[int, float, int]]]


def _steady_graph(
    slot_ms: Sequence[float], num_devices: int, rounds: Sequence[int], lead_ms: Sequence[float] | None = None
) -> Arcs:
    """In-arcs (source, weight ms, transit in iterations) of every node; run n of one iteration has
    node 2n (its first microbatch starts) and 2n+1 (its last microbatch ends). ``lead_ms[i]`` is
    the part of slot i's microbatch that runs before its input from slot i-1 has arrived (a
    backward stage's recompute needs only the saved activation): the arcs from slot i-1 are
    shorter by it."""
    lead = lead_ms or [0.0] * len(slot_ms)
    s_count = len(slot_ms)
    period = s_count * len(rounds)
    ins: Arcs = [[] for _ in range(2 * period)]

    def earlier(n: int, back: int) -> tuple[int, int]:
        q, m = divmod(n - back, period)
        return m, -q

    for n in range(period):
        rnd, i = divmod(n, s_count)
        busy = rounds[rnd] * slot_ms[i]
        start, end = 2 * n, 2 * n + 1
        if i:  # microbatch 0 arrives from the previous slot of the round
            ins[start].append((2 * (n - 1), slot_ms[i - 1] - lead[i], 0))
        src, q = earlier(n, num_devices)  # the device's previous run
        ins[start].append((2 * src, rounds[src // s_count] * slot_ms[src % s_count], q))
        src, q = earlier(n, 2 * num_devices)  # one stage of prefetch: the run before that has ended
        ins[start].append((2 * src + 1, 0.0, q))
        ins[end].append((start, busy, 0))
        if i:  # the last microbatch cannot end before it left the previous slot
            ins[end].append((2 * (n - 1) + 1, slot_ms[i] - lead[i], 0))
    return ins


def _value_policy(ins: Arcs, policy: list[int], x: list[float], eta: list[float]) -> None:
    """Each node's cycle ratio (eta) and bias (x) in the graph where it keeps only its policy arc."""
    count = len(ins)
    state = [0] * count  # 0 new, 1 on the current path, 2 valued
    for first in range(count):
        if state[first]:
            continue
        path = []
        v = first
        while not state[v]:
            state[v] = 1
            path.append(v)
            v = ins[v][policy[v]][0]
        stop = len(path)
        if state[v] == 1:  # a new cycle: path[k:] in reverse arc order
            k = path.index(v)
            cycle = path[k:]
            # left to right, as the compiled loop adds them: Python 3.12's sum() of floats is
            # compensated, and would give another period than `native` there
            weight, transit = 0.0, 0
            for c in cycle:
                weight += ins[c][policy[c]][1]
                transit += ins[c][policy[c]][2]
            ratio = weight / transit
            for j in range(len(path) - 1, k, -1):  # the anchor path[k] keeps its bias
                c = path[j]
                u, w, t = ins[c][policy[c]]
                x[c] = x[u] + w - ratio * t
                eta[c] = ratio
            eta[v] = ratio
            stop = k
        for j in range(stop - 1, -1, -1):
            c = path[j]
            u, w, t = ins[c][policy[c]]
            eta[c] = eta[u]
            x[c] = x[u] + w - eta[u] * t
        for c in path:
            state[c] = 2


def _improve_policy(ins: Arcs, policy: list[int], x: list[float], eta: list[float], tol: float) -> bool:
    """Switch nodes to an in-arc with a larger ratio, else (same ratio) a larger bias; True if any did."""
    changed = False
    for v, arcs in enumerate(ins):
        best = eta[arcs[policy[v]][0]]
        for j, (u, _, _) in enumerate(arcs):
            if eta[u] > best + tol:
                best, policy[v], changed = eta[u], j, True
    if changed:
        return True
    for v, arcs in enumerate(ins):
        u, w, t = arcs[policy[v]]
        best = x[u] + w - eta[u] * t
        for j, (u, w, t) in enumerate(arcs):
            if abs(eta[u] - eta[v]) <= tol and x[u] + w - eta[u] * t > best + tol * 1e3:
                best, policy[v], changed = x[u] + w - eta[u] * t, j, True
    return changed


def steady_period(
    slot_ms: Sequence[float], num_devices: int, rounds: Sequence[int], lead_ms: Sequence[float] | None = None
) -> float:
    """Milliseconds per iteration of an endless async stream of iterations (the model above).

    Every zero-transit arc goes forward within a round, so every cycle has a positive transit and
    the ratio is well defined. Policy iteration: each node keeps one in-arc; the policy graph's
    cycles give each node a ratio (eta) and a bias (x); nodes switch to a better in-arc until
    nothing improves.
    """
    count = 2 * len(slot_ms) * len(rounds)  # the graph's nodes
    tol = 1e-12 * max(1.0, max(slot_ms, default=0.0) * max(rounds) * count)
    kernels = native.kernels()
    if kernels is not None and slot_ms and rounds:  # graph, first policy and iteration compiled
        return kernels.steady_period_of(  # type: ignore[no-any-return]
            native.floats(slot_ms), num_devices, native.ints(rounds), native.floats(lead_ms or ()), tol
        )
    ins = _steady_graph(slot_ms, num_devices, rounds, lead_ms)
    # Start from the heaviest arc that crosses the most iterations: close to the final policy.
    policy = [max(range(len(arcs)), key=[(t, w) for _, w, t in arcs].__getitem__) for arcs in ins]
    x = [0.0] * count
    eta = [0.0] * count
    for _ in range(4 * count + 16):
        _value_policy(ins, policy, x, eta)
        if not _improve_policy(ins, policy, x, eta, tol):
            return max(eta)
    raise AssertionError("policy iteration did not converge")  # finite policies: cannot happen


def steady_bound_ticks(slots: Sequence[int], num_devices: int, rounds: Sequence[int]) -> float:
    """`steady_bound` of integer slot times (`_candidates.steady_search`'s ticks, far under 2**53):
    compiled where `native` was built (a fifth of the steady search's time at 94 layers in
    Python), the same float."""
    kernels = native.kernels()
    if kernels is not None:
        return kernels.steady_bound_ticks(native.ints(slots), num_devices, native.ints(rounds))  # type: ignore[no-any-return]
    return steady_bound(slots, num_devices, rounds)


def steady_bound(slot_ms: Sequence[float], num_devices: int, rounds: Sequence[int]) -> float:
    """A lower bound of `steady_period`, in O(S): the ratios of two kinds of cycles of its graph.

    Device cycles: a device's runs visit the slots i, i+N, i+2N, ... (mod S), a class of
    S/g slots (g = gcd(S, N)), and the class's runs must follow each other on N/g devices. Wave
    cycles: the first microbatch walks slots h-D..h (D = S-N >= 0) and slot h's device then runs
    slot h-D of the next round, so each round that chain plus slot h's whole run follow each other.
    """
    s_count, n = len(slot_ms), num_devices
    bound = sum(rounds) * math.fsum(slot_ms) / n  # N devices share all the work of an iteration
    g = math.gcd(s_count, n)
    if g > 1 and len(set(rounds)) == 1:  # each device only ever sees one class of slots
        bound = max(bound, sum(rounds) * g * max(math.fsum(slot_ms[i::g]) for i in range(g)) / n)
    d = s_count - n
    if d >= 0:  # (with fewer slots than devices, a device's next run is not in the next round)
        for h in range(d, s_count):  # one wave cycle per round, around the iteration
            bound = max(bound, len(rounds) * math.fsum(slot_ms[h - d : h]) + sum(rounds) * slot_ms[h])
    return bound
