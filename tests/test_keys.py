"""Task keys, kinds and states: named, scoped to an iteration or a step, and plain strings and
lists in JSON, so traces of every version load as named keys."""

from __future__ import annotations

import json
from pathlib import Path

from roundpipe.plan import LayerCosts, partition
from roundpipe.plan.kinds import SlotKind
from roundpipe.sched import simulate
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.keys import ITERATION_KEYS, STEP_KEYS, ComputeKey, GCopyKey, GradDownKey, StepKey
from roundpipe.sched.kinds import TaskKind, TaskState
from roundpipe.sched.task import COMPUTE, STEP
from roundpipe.sched.trace import TRACE_FORMAT, Trace


def test_loaded_keys_kinds_and_states_are_the_named_types(tmp_path: Path) -> None:
    costs = LayerCosts((1.0, 1.25, 0.75, 2.0, 1.5), (2.0, 2.5, 1.5, 4.0, 6.0), (3 << 20,) * 5)
    ran = simulate(partition(costs, 3, 6), costs, 3, 6, 3, act_bytes=1 << 20, link_gbps=16.0).trace
    loaded = Trace.load(ran.save(tmp_path / "run.json"))
    for a, b in zip(ran, loaded, strict=True):
        assert type(b.key) is type(a.key) and b.key == a.key
        assert [type(d) for d in b.deps] == [type(d) for d in a.deps]
        assert isinstance(b.kind, TaskKind) and isinstance(b.state, TaskState)
        assert b.stage_kind == "" or isinstance(b.stage_kind, SlotKind)
    # A key is named, belongs to an iteration or a step, and still equals the tuple it spells.
    compute = next(t for t in loaded if t.kind == COMPUTE)
    assert isinstance(compute.key, ComputeKey) and compute.key.iteration == compute.iteration
    assert compute.key == ("compute", compute.iteration, compute.slot, compute.microbatch)
    step = next(t for t in loaded if t.kind == STEP)
    assert isinstance(step.key, StepKey) and step.key.step == step.step and step.key.unit == step.layers.start
    # Kinds, states and stage kinds are written as plain strings.
    raw = json.loads(json.dumps(loaded.to_dict()))
    assert {d["state"] for d in raw["tasks"]} == {"done"}
    assert raw["tasks"][0]["key"][0] in {k.value for k in TaskKind}


def test_every_built_key_names_its_iteration_or_its_step() -> None:
    """What retention reads: a device task or G-copy key has the task's iteration, an optimizer
    task key the task's step; none has both."""
    costs = LayerCosts.uniform(6)
    spec = ModelSpec.uniform(6, param_bytes=100)
    builder = GraphBuilder(
        partition(costs, 2, 4), spec, 2, ScheduleOptions(async_optimizer=False, grad_norm_barrier=True)
    )
    tasks = [
        t
        for it in range(2)
        for t in (*builder.forward_backward(it, it, 4).tasks, *builder.optimizer_step(it))
    ]
    assert {t.kind for t in tasks} == set(TaskKind)
    for task in tasks:
        assert task.key.kind == task.kind
        if isinstance(task.key, ITERATION_KEYS):
            assert task.key.iteration == task.iteration and not hasattr(task.key, "step")
        else:
            assert isinstance(task.key, STEP_KEYS) and task.key.step == task.step


def test_a_trace_of_positional_keys_loads_with_named_keys() -> None:
    """Traces written before keys had names store the same lists: they load unchanged."""
    record = {
        "key": ["grad_down", 2, 1, 4],
        "kind": "grad_down",
        "lane": "d1.grad_down",
        "priority": 10,
        "deps": [["compute", 2, 4, 7], ["g_copy", 1, 3], ["custom", 1]],
        "device": 1,
        "layers": [3, 5],
        "stage": "B2",
        "stage_kind": "bwd",
        "slot": 4,
        "microbatch": -1,
        "iteration": 2,
        "round": 1,
        "step": 2,
        "part": 0,
        "num_parts": 1,
        "nbytes": 10,
        "seq": 5,
        "submit": 0.0,
        "ready": 1.0,
        "start": 1.0,
        "end": 2.0,
        "state": "done",
    }
    task = Trace.from_dict({"format": TRACE_FORMAT, "tasks": [record]})[0]
    assert task.key == GradDownKey(2, 1, 4) and type(task.key) is GradDownKey
    assert task.deps == (ComputeKey(2, 4, 7), GCopyKey(1, 3), ("custom", 1))
    assert task.stage_kind == SlotKind.BWD and task.state == TaskState.DONE
    # A record written before the issue-ahead fields existed gets their defaults.
    assert task.to_dict() == {**record, "sync_deps": [], "issue": -1.0}
