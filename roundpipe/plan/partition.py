"""Plans: how the layers split into forward stages, one fused stage and backward stages.

A `Plan` is what the scheduler dispatches: the slots ``F1..Fk, FB, Bk..B1`` and the layers each
runs. `partition` chooses the plan that minimises the pipeline objective (see `objective`) for
given layer costs, device count, microbatch count and memory limit, or, for the async optimizer
with ``steady=True``, the shortest modelled steady-state iteration; `Plan.from_stages` checks a
hand-made one. Plans are immutable values that validate on construction, so a plan that exists is
well formed. This module must never run, time or place anything: it only decides stage borders.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roundpipe.errors import PlanError
from roundpipe.plan import _search, _steady_search
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.kinds import SlotKind
from roundpipe.plan.rounds import as_count, round_sizes

_KINDS = tuple(SlotKind)
_PLAN_KEYS = ("fwd_stages", "fused", "bwd_stages", "t_max", "num_devices", "num_microbatches", "slot_ms")


@dataclass(frozen=True)
class Slot:
    """One stage in dispatch order: ``index`` counts slots from 0 (F1 is 0, B1 is the last).

    ``number`` is the k of ``Fk``/``Bk`` (`Plan.slots` sets it); left at 0 a forward slot is
    numbered ``index + 1``. B1 is the *shallowest* backward stage, i.e. the last slot.
    """

    index: int
    kind: SlotKind
    layers: range
    number: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PlanError(
                f"slot {self.index} has kind {self.kind!r}; a slot kind is one of {[str(k) for k in _KINDS]}"
            )
        object.__setattr__(self, "kind", SlotKind(self.kind))
        if not isinstance(self.layers, range) or self.layers.step != 1 or len(self.layers) == 0:
            raise PlanError(
                f"slot {self.index} needs a non-empty range of consecutive layers, got {self.layers!r}"
            )

    @property
    def name(self) -> str:
        if self.kind == SlotKind.FUSED:
            return "FB"
        if self.kind == SlotKind.FWD:
            return f"F{self.number or self.index + 1}"
        return f"B{self.number}" if self.number else f"B(slot {self.index})"


def _as_range(what: str, value: object) -> range:
    """A stage given as ``range(a, b)`` or a ``[a, b]`` pair."""
    if isinstance(value, range):
        if value.step != 1:
            raise PlanError(f"{what} {value!r} must have step 1 (stages are consecutive layers)")
        return value
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    ):
        return range(value[0], value[1])
    raise PlanError(f"{what} must be a range or a [start, stop] pair of layer indices, got {value!r}")


def _check_chain(what: str, stages: Sequence[range], start: int, stop: int, descending: bool) -> None:
    """``stages`` are non-empty and tile [start, stop) in order (shallow first, or deepest first)."""
    order = "deepest" if descending else "shallowest"
    walk = list(enumerate(stages))
    if descending:
        walk.reverse()
    at = start
    for i, r in walk:
        if len(r) == 0:
            raise PlanError(f"{what}[{i}] = {r!r} is empty; every stage needs at least one layer")
        if r.start != at:
            raise PlanError(
                f"{what}[{i}] = [{r.start}, {r.stop}) should start at layer {at}: {what} must cover "
                f"layers [{start}, {stop}) exactly once, {order} stage first"
            )
        at = r.stop
    if at != stop:
        raise PlanError(
            f"{what} cover layers [{start}, {at}) but must cover [{start}, {stop}) exactly "
            f"(every layer before the fused stage), {order} stage first"
        )


@dataclass(frozen=True)
class Plan:
    """Forward stages (shallow first), the fused stage (deepest layers), backward stages (deepest first).

    ``t_max`` is the slowest stage (ms per microbatch) under the costs the plan was built for;
    ``slot_ms`` (when known) is each slot's time in dispatch order, for printing and checks.
    """

    fwd_stages: tuple[range, ...]
    fused: range
    bwd_stages: tuple[range, ...]
    t_max: float
    num_devices: int
    num_microbatches: int
    slot_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        fwd = tuple(_as_range(f"fwd_stages[{i}]", r) for i, r in enumerate(self.fwd_stages))
        bwd = tuple(_as_range(f"bwd_stages[{i}]", r) for i, r in enumerate(self.bwd_stages))
        fused = _as_range("fused", self.fused)
        if len(fused) == 0 or fused.start < 0:
            raise PlanError(f"the fused stage {fused!r} must hold at least one layer (the deepest ones)")
        _check_chain("fwd_stages", fwd, 0, fused.start, descending=False)
        _check_chain("bwd_stages", bwd, 0, fused.start, descending=True)
        as_count("num_devices", self.num_devices, "a plan is for at least one device")
        as_count("num_microbatches", self.num_microbatches, "a plan is for at least one microbatch")
        if isinstance(self.t_max, bool) or not isinstance(self.t_max, (int, float)):
            raise PlanError(f"t_max must be a number of milliseconds, got {self.t_max!r}")
        if not math.isfinite(self.t_max) or self.t_max < 0:
            raise PlanError(f"t_max is {self.t_max!r}; it must be a finite number of milliseconds >= 0")
        slot_ms = tuple(float(x) for x in self.slot_ms)
        if slot_ms:
            count = len(fwd) + 1 + len(bwd)
            if len(slot_ms) != count:
                raise PlanError(f"slot_ms has {len(slot_ms)} entries but the plan has {count} slots")
            if not all(math.isfinite(x) and x >= 0 for x in slot_ms):
                raise PlanError(f"slot_ms {list(slot_ms)} must hold finite times >= 0")
            if not math.isclose(max(slot_ms), self.t_max, rel_tol=1e-9, abs_tol=1e-12):
                raise PlanError(f"t_max {self.t_max} is not the slowest slot time {max(slot_ms)}")
        object.__setattr__(self, "fwd_stages", fwd)
        object.__setattr__(self, "bwd_stages", bwd)
        object.__setattr__(self, "fused", fused)
        object.__setattr__(self, "t_max", float(self.t_max))
        object.__setattr__(self, "slot_ms", slot_ms)

    @property
    def num_layers(self) -> int:
        return self.fused.stop

    @property
    def num_slots(self) -> int:
        return len(self.fwd_stages) + 1 + len(self.bwd_stages)

    @functools.cached_property
    def slots(self) -> tuple[Slot, ...]:
        """Dispatch order: F1..Fk, FB, Bk..B1. (Built once: plan evaluation reads it per replay,
        and each `Slot` checks itself.)"""
        k = len(self.fwd_stages)
        out = [Slot(i, SlotKind.FWD, r, i + 1) for i, r in enumerate(self.fwd_stages)]
        out.append(Slot(k, SlotKind.FUSED, self.fused))
        nb = len(self.bwd_stages)
        out += [Slot(k + 1 + j, SlotKind.BWD, r, nb - j) for j, r in enumerate(self.bwd_stages)]
        return tuple(out)

    @property
    def bwd_boundaries(self) -> frozenset[int]:
        """Layers where a backward stage or the fused stage starts: forward stages save the
        activation entering these layers (layer 0's is the input itself)."""
        return frozenset([self.fused.start, *(r.start for r in self.bwd_stages)])

    def stage_ms(self, costs: LayerCosts) -> tuple[float, ...]:
        """Each slot's time per microbatch under ``costs``, in dispatch order."""
        if costs.num_layers != self.num_layers:
            raise PlanError(
                f"the plan covers {self.num_layers} layers but the costs describe {costs.num_layers}; "
                "re-plan with partition() for these costs"
            )
        timer = {
            SlotKind.FWD: costs.fwd_stage_ms,
            SlotKind.FUSED: costs.fused_stage_ms,
            SlotKind.BWD: costs.bwd_stage_ms,
        }
        return tuple(timer[s.kind](s.layers) for s in self.slots)

    @classmethod
    def from_stages(
        cls,
        fwd: Sequence[range | Sequence[int]],
        fused: range | Sequence[int],
        bwd: Sequence[range | Sequence[int]],
        costs: LayerCosts,
        num_devices: int,
        num_microbatches: int,
        *,
        mem_limit_bytes: int | None = None,
    ) -> Plan:
        """A hand-made plan, checked: coverage, order, non-empty stages, fused stage ending at the
        last layer of ``costs``, and (when a limit is given) the memory rule of `partition`."""
        fused_r = _as_range("fused", fused)
        if fused_r.stop != costs.num_layers:
            raise PlanError(
                f"the fused stage {fused_r!r} must hold the deepest layers, i.e. stop at {costs.num_layers} "
                f"(the costs describe {costs.num_layers} layers)"
            )
        fwd_r = tuple(_as_range(f"fwd_stages[{i}]", r) for i, r in enumerate(fwd))
        bwd_r = tuple(_as_range(f"bwd_stages[{i}]", r) for i, r in enumerate(bwd))
        shape = cls(fwd_r, fused_r, bwd_r, 0.0, num_devices, num_microbatches)
        if mem_limit_bytes is not None:
            _check_memory(costs, mem_limit_bytes, shape)
        times = shape.stage_ms(costs)
        return cls(
            shape.fwd_stages, shape.fused, shape.bwd_stages, max(times), num_devices, num_microbatches, times
        )

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "fwd_stages": [[r.start, r.stop] for r in self.fwd_stages],
            "fused": [self.fused.start, self.fused.stop],
            "bwd_stages": [[r.start, r.stop] for r in self.bwd_stages],
            "t_max": self.t_max,
            "num_devices": self.num_devices,
            "num_microbatches": self.num_microbatches,
        }
        if self.slot_ms:
            d["slot_ms"] = list(self.slot_ms)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_PLAN_KEYS))
        if unknown:
            raise PlanError(f"unknown key(s) {unknown} in plan; the accepted keys are {list(_PLAN_KEYS)}")
        missing = [k for k in _PLAN_KEYS[:-1] if k not in d]
        if missing:
            raise PlanError(f"the plan lacks {missing}")
        for key in ("fwd_stages", "bwd_stages"):
            if isinstance(d[key], (str, bytes)) or not isinstance(d[key], Sequence):
                raise PlanError(f"{key} must be a list of [start, stop] pairs, got {d[key]!r}")
        return cls(
            tuple(d["fwd_stages"]),
            d["fused"],
            tuple(d["bwd_stages"]),
            d["t_max"],
            d["num_devices"],
            d["num_microbatches"],
            tuple(d.get("slot_ms", ())),
        )

    def to_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)
            fh.write("\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Plan:
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def __str__(self) -> str:
        head = (
            f"Plan: {self.num_layers} layers in {self.num_slots} slots "
            f"({len(self.fwd_stages)} fwd, 1 fused, {len(self.bwd_stages)} bwd) for "
            f"{self.num_devices} devices x {self.num_microbatches} microbatches, t_max {self.t_max:.4g} ms"
        )
        rows = [("slot", "kind", "layers", "ms")]
        for s in self.slots:
            ms = f"{self.slot_ms[s.index]:.4g}" if self.slot_ms else "-"
            rows.append((s.name, s.kind, f"{s.layers.start}-{s.layers.stop - 1}", ms))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = [head]
        for r in rows:
            lines.append(
                "  ".join(r[c].ljust(widths[c]) if c < 3 else r[c].rjust(widths[c]) for c in range(4))
            )
        return "\n".join(lines)


def objective(
    plan: Plan | tuple[int, float],
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool = False,
) -> float:
    """What `partition` minimises, in ms (slot-time units of device time, up to a factor 1/N).

    Sync: ``(M*S + N*(N-1)) * t_max``, the fill and drain of every iteration included. Async
    (iterations chain, no flush): ``M * max(S, N) * t_max``, the steady state; fewer slots than
    devices is counted as N slots, because a round then leaves devices without work.
    """
    n = as_count("num_devices", num_devices, "pass the number of devices")
    m = as_count("num_microbatches", num_microbatches, "pass the number of microbatches")
    if isinstance(plan, Plan):
        slots, t_max = plan.num_slots, plan.t_max
    else:
        slots, t_max = plan
    if async_optimizer:
        return float(m * max(slots, n) * t_max)
    return float((m * slots + n * (n - 1)) * t_max)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n} bytes ({n / size:.2f} {unit})"
    return f"{n} bytes"


def _check_memory(costs: LayerCosts, limit: int, plan: Plan | None = None) -> int:
    """The memory rule: a stage may use at most ``limit // 2`` bytes, so it fits together with
    the next stage its device prefetches, whatever that stage is. Returns that per-stage cap."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise PlanError(
            f"mem_limit_bytes must be a positive integer number of bytes (or None), got {limit!r}"
        )
    cap = limit // 2
    for i, b in enumerate(costs.mem_bytes):
        if b > cap:
            raise PlanError(
                f"{costs.label(i)} needs {_fmt_bytes(b)}, but a stage and the stage prefetched behind it "
                f"must fit together in mem_limit_bytes={_fmt_bytes(limit)}, so one stage may use at most "
                f"{_fmt_bytes(cap)}. Lower that layer's memory (fewer tokens per "
                "microbatch: more microbatches or shorter sequences; recompute grain 'layer'), or use a "
                "device with more memory (a larger mem_limit_bytes)."
            )
    if plan is not None:
        for s in plan.slots:
            b = costs.stage_mem(s.layers)
            if b > cap:
                raise PlanError(
                    f"stage {s.name} (layers {s.layers.start}-{s.layers.stop - 1}) needs {_fmt_bytes(b)}, over "
                    f"the per-stage cap {_fmt_bytes(cap)} = mem_limit_bytes {limit} // 2 (one stage is prefetched); "
                    "split it into smaller stages"
                )
    return cap


def partition(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    mem_limit_bytes: int | None = None,
    *,
    async_optimizer: bool = False,
    steady: bool = False,
    round_size: int | None = None,
) -> Plan:
    """The plan with the least `objective` whose every stage fits ``mem_limit_bytes // 2``.

    Ties go to fewer slots, then to a longer fused stage. Exact: the search (see ``_search``)
    visits every slot count that could still win, at its least possible t_max.

    ``steady=True`` (async only) chooses by the steady-state model of round-robin dispatch instead
    (``_steady.steady_period``, rounds as `roundpipe.plan.round_sizes` makes them with
    ``round_size``): the plan with the shortest modelled iteration of an endless async run, its
    chains cut evenly with the larger stages first in dispatch order. The t_max objective counts
    every slot at t_max; in the steady state what costs time is how the stream of runs paces
    itself, which depends on where the heavy stages sit (docs/performance.md).
    """
    if not isinstance(costs, LayerCosts):
        raise PlanError(f"costs must be a LayerCosts, got {type(costs).__name__}")
    n = as_count("num_devices", num_devices, "pass the number of GPUs (or CPU workers) to plan for")
    m = as_count("num_microbatches", num_microbatches, "split each batch into at least one microbatch")
    if steady and not async_optimizer:
        raise PlanError(
            "steady=True models the steady state of asynchronous iterations; with async_optimizer=False "
            "every iteration fills and drains the pipeline, which the default objective already counts"
        )
    cap = None if mem_limit_bytes is None else _check_memory(costs, mem_limit_bytes)
    total = math.fsum(costs.fwd_ms) * 2 + math.fsum(costs.bwd_ms)
    if not math.isfinite(total):
        raise PlanError(f"the layer times add up to {total}; express them in milliseconds")
    fwd, fb = _search.to_ticks(costs.fwd_ms, costs.bwd_ms)
    ticks = _search.Ticks(fwd, fb, costs.mem_bytes, cap)
    if steady:
        rounds = round_sizes(m, n, round_size)
        if len(set(rounds)) == 1:
            rounds = rounds[:1]  # rounds alike: one round is already the period of the stream
        found = _steady_search.steady_search(ticks, n, rounds)
        if found is not None:
            return Plan.from_stages(*found, costs, n, m)
        # No candidate lies where the model can be trusted: the t_max objective decides.
    if async_optimizer:
        t = _search.search(ticks, m, fill_drain=0, slot_floor=n)
    else:
        t = _search.search(ticks, m, fill_drain=n * (n - 1), slot_floor=0)
    fwd_stages, fused, bwd_stages = ticks.stages(t)
    return Plan.from_stages(fwd_stages, fused, bwd_stages, costs, n, m)
