"""The Trace as data: JSON round trip, replay, bubble ratio, Perfetto tracks, PNG, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe.backends.fake import Perturbation
from roundpipe.plan import LayerCosts, Plan, partition
from roundpipe.planning.simulate import replay, simulate
from roundpipe.sched.task import ACT_UP, COMPUTE, PARAM_UP, STEP, Task
from roundpipe.sched.trace import TRACE_FORMAT, Trace

# Every field a recorded task carries (declared and run-time) that must survive a save/load.
FIELDS = (
    "key",
    "kind",
    "lane",
    "priority",
    "deps",
    "device",
    "layers",
    "stage",
    "stage_kind",
    "slot",
    "microbatch",
    "iteration",
    "round",
    "step",
    "part",
    "num_parts",
    "nbytes",
    "seq",
    "submit_t",
    "ready_t",
    "start_t",
    "end_t",
    "state",
)

PERTURBATION = Perturbation(
    delay_ms={COMPUTE: 0.3, "grad_down": 0.2}, jitter={COMPUTE: 0.4, ACT_UP: 0.5, STEP: 0.2}, seed=7
)


def _simulated(
    *,
    num_devices: int = 3,
    num_microbatches: int = 6,
    iterations: int = 3,
    async_optimizer: bool = True,
    perturbation: Perturbation | None = None,
    shared_link: bool = True,
) -> Trace:
    costs = LayerCosts((1.0, 1.25, 0.75, 2.0, 1.5), (2.0, 2.5, 1.5, 4.0, 6.0), (3 << 20,) * 5)
    plan = partition(costs, num_devices, num_microbatches, async_optimizer=async_optimizer)
    result = simulate(
        plan,
        costs,
        num_devices,
        num_microbatches,
        iterations,
        async_optimizer,
        12.0,
        act_bytes=1 << 20,
        chunk_bytes=1 << 20,
        optimizer_ms=0.4,
        shared_link=shared_link,
        perturbation=perturbation,
    )
    return result.trace


@pytest.fixture(scope="module")
def fake_trace() -> Trace:
    return _simulated()


@pytest.fixture(scope="module")
def perturbed_trace() -> Trace:
    return _simulated(perturbation=PERTURBATION, async_optimizer=False)


def _fields(task: Task) -> dict[str, object]:
    return {name: getattr(task, name) for name in FIELDS}


def _times(trace: Trace) -> dict[tuple[object, ...], tuple[float, float, float]]:
    return {t.key: (t.ready_t, t.start_t, t.end_t) for t in trace}


# --------------------------------------------------------------------- JSON


def test_save_load_round_trip_keeps_every_field(fake_trace: Trace, tmp_path: Path) -> None:
    path = fake_trace.save(tmp_path / "deep" / "run.trace.json")
    assert path.exists()
    assert [p.name for p in path.parent.iterdir()] == ["run.trace.json"]  # no temp file left
    with open(path) as f:
        raw = json.load(f)
    assert raw["format"] == TRACE_FORMAT
    assert len(raw["tasks"]) == len(fake_trace)

    loaded = Trace.load(path)
    assert len(loaded) == len(fake_trace)
    for a, b in zip(fake_trace, loaded, strict=True):
        assert _fields(a) == _fields(b)
        assert isinstance(b.key, tuple) and all(isinstance(d, tuple) for d in b.deps)
        assert isinstance(b.layers, range)
    assert loaded.meta == json.loads(json.dumps(fake_trace.meta))
    assert loaded.meta["owners"] == [[u] for u in range(5)]


def test_a_gz_path_saves_and_loads_gzipped_json(fake_trace: Trace, tmp_path: Path) -> None:
    import gzip

    path = fake_trace.save(tmp_path / "run.trace.json.gz")
    assert [p.name for p in tmp_path.iterdir()] == ["run.trace.json.gz"]  # no temp file left
    with gzip.open(path, "rt") as f:
        assert json.load(f) == fake_trace.to_dict()
    loaded = Trace.load(path)
    assert [_fields(t) for t in loaded] == [_fields(t) for t in fake_trace]
    assert loaded.to_dict() == json.loads(json.dumps(fake_trace.to_dict()))
    # Derived views agree too.
    assert loaded.order() == fake_trace.order()
    assert loaded.bubble_ratio() == fake_trace.bubble_ratio()
    assert loaded.makespan_ms() == fake_trace.makespan_ms()
    loaded.check_rules()


def test_round_trip_of_a_hand_made_task_with_no_default_fields(tmp_path: Path) -> None:
    task = Task(
        ("param_up", 4, 1, 2, 7, 3),
        PARAM_UP,
        "d3.param_up",
        deps=[("p_copy", 2, 7), ("compute", 4, 0, 5)],
        priority=21,
        device=3,
        layers=range(7, 8),
        stage="B2",
        stage_kind="bwd",
        slot=2,
        microbatch=5,
        iteration=4,
        round=1,
        step=3,
        part=3,
        num_parts=4,
        nbytes=123457,
    )
    task.seq, task.submit_t, task.ready_t, task.start_t, task.end_t = 99, 0.5, 1.25, 1.5, 2.0625
    task.state = "done"
    trace = Trace([task], meta={"num_devices": 4, "async_optimizer": False, "note": [1, 2]})
    loaded = Trace.load(trace.save(tmp_path / "one.json"))
    assert _fields(loaded[0]) == _fields(task)
    assert loaded.meta == {"num_devices": 4, "async_optimizer": False, "note": [1, 2]}
    assert loaded[0].describe() == task.describe()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2, 3]", r"not a roundpipe trace \(a JSON array"),
        ('{"fwd_stages": [], "fused": [0, 1]}', r"not a roundpipe trace \(format None"),
        ('{"format": "roundpipe.trace/0", "tasks": []}', r"format 'roundpipe.trace/0', expected"),
        ('{"format": "roundpipe.trace/1"}', r'"tasks" is a JSON null, expected an array'),
        ('{"format": "roundpipe.trace/1", "tasks": [{"key": [1]}]}', r"task record 0 is malformed"),
        ('{"format": "roundpipe.trace/1", "tasks": [], "meta": 3}', r'"meta" is a JSON number'),
        ('"a string"', r"a JSON string"),
    ],
)
def test_load_of_something_else_raises_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        Trace.load(path)


def test_load_of_broken_json_raises_value_error(tmp_path: Path, fake_trace: Trace) -> None:
    path = fake_trace.save(tmp_path / "t.json")
    path.write_text(path.read_text()[:100])  # truncated
    with pytest.raises(ValueError):
        Trace.load(path)
    with pytest.raises(FileNotFoundError):
        Trace.load(tmp_path / "missing.json")


def test_empty_trace_round_trip_and_metrics(tmp_path: Path) -> None:
    loaded = Trace.load(Trace().save(tmp_path / "empty.json"))
    assert len(loaded) == 0 and loaded.meta == {}
    report = loaded.bubble_ratio()
    assert (report.per_device, report.overall, report.makespan_ms) == ({}, 0.0, 0.0)
    assert loaded.makespan_ms() == 0.0
    loaded.check_rules()


# --------------------------------------------------------------------- replay


def _assert_replays_exactly(trace: Trace) -> Trace:
    again = replay(trace)
    assert again.order() == trace.order()
    assert _times(again) == _times(trace)
    again.check_rules()
    return again


def test_replay_of_a_saved_fake_trace_gives_the_same_order(fake_trace: Trace, tmp_path: Path) -> None:
    loaded = Trace.load(fake_trace.save(tmp_path / "t.json"))
    again = _assert_replays_exactly(loaded)
    assert loaded.replay().order() == again.order()  # the method and the function agree
    assert again.meta == loaded.meta


def test_replay_uses_recorded_durations_of_a_perturbed_run(perturbed_trace: Trace, tmp_path: Path) -> None:
    plain = _simulated(async_optimizer=False)
    assert _times(plain) != _times(perturbed_trace)  # the perturbation changed the run...
    loaded = Trace.load(perturbed_trace.save(tmp_path / "p.json"))
    _assert_replays_exactly(loaded)  # ...and replay reproduces it without knowing the perturbation


def test_replay_without_a_shared_link(tmp_path: Path) -> None:
    trace = _simulated(shared_link=False, perturbation=PERTURBATION, num_devices=2)
    assert trace.meta["shared_link"] is False
    _assert_replays_exactly(Trace.load(trace.save(tmp_path / "s.json")))


def test_replay_of_a_trace_without_batch_information_still_obeys_the_rules(fake_trace: Trace) -> None:
    """A trace from elsewhere (no submission batches, no link sharing recorded) still replays:
    the same tasks, each with its recorded duration, dependencies and rules respected."""
    bare = Trace.from_dict(fake_trace.to_dict())
    bare.meta = {"owners": fake_trace.meta["owners"]}
    again = replay(bare)
    assert sorted(t.key for t in again) == sorted(t.key for t in fake_trace)
    recorded = {t.key: t.end_t - t.start_t for t in fake_trace}
    for t in again:
        assert t.end_t - t.start_t == pytest.approx(recorded[t.key], abs=1e-9)
    again.check_rules()


@settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    num_devices=st.integers(1, 5),
    num_microbatches=st.integers(1, 12),
    iterations=st.integers(1, 3),
    async_optimizer=st.booleans(),
    shared_link=st.booleans(),
    seed=st.one_of(st.none(), st.integers(0, 1000)),
)
def test_replay_reproduces_random_fake_runs(
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    async_optimizer: bool,
    shared_link: bool,
    seed: int | None,
) -> None:
    perturbation = None
    if seed is not None:
        perturbation = Perturbation(
            delay_ms={PARAM_UP: 0.1}, jitter={COMPUTE: 0.5, "act_down": 0.9}, seed=seed
        )
    trace = _simulated(
        num_devices=num_devices,
        num_microbatches=num_microbatches,
        iterations=iterations,
        async_optimizer=async_optimizer,
        shared_link=shared_link,
        perturbation=perturbation,
    )
    _assert_replays_exactly(Trace.from_dict(json.loads(json.dumps(trace.to_dict()))))


# --------------------------------------------------------------------- metrics


def _done(key: str, kind: str, lane: str, device: int, start: float, end: float, seq: int) -> Task:
    task = Task((key,), kind, lane, device=device)
    task.seq, task.submit_t, task.ready_t, task.start_t, task.end_t = seq, 0.0, start, start, end
    task.state = "done"
    return task


@pytest.fixture
def hand_made() -> Trace:
    """Two devices; d0 computes [0, 2] and [4, 8], d1 computes [2, 6]; transfers and a host step
    around them do not count as compute."""
    return Trace(
        [
            _done("up", PARAM_UP, "d0.param_up", 0, -1.0, 0.0, 0),
            _done("c0", COMPUTE, "d0.compute", 0, 0.0, 2.0, 1),
            _done("c1", COMPUTE, "d1.compute", 1, 2.0, 6.0, 2),
            _done("down", "act_down", "d1.act_down", 1, 6.0, 6.5, 3),
            _done("c2", COMPUTE, "d0.compute", 0, 4.0, 8.0, 4),
            _done("st", STEP, "host.optimizer", -1, 8.0, 10.0, 5),
        ]
    )


def test_bubble_ratio_per_device_exact(hand_made: Trace) -> None:
    report = hand_made.bubble_ratio()  # window [0, 8]: the first to the last compute
    assert report.per_device == {0: 0.25, 1: 0.5}  # busy 6 of 8 and 4 of 8
    assert report.overall == 0.375
    assert float(report) == 0.375
    assert report.makespan_ms == 8.0
    assert report.busy_ms == {0: 6.0, 1: 4.0}
    assert hand_made.makespan_ms() == 11.0  # all tasks: -1 .. 10

    window = hand_made.bubble_ratio(start_ms=2.0, end_ms=6.0)  # d0 busy [4, 6], d1 all of it
    assert window.per_device == {0: 0.5, 1: 0.0}
    assert window.overall == 0.25
    assert window.busy_ms == {0: 2.0, 1: 4.0}
    assert window.makespan_ms == 4.0

    outside = hand_made.bubble_ratio(start_ms=10.0, end_ms=12.0)
    assert outside.per_device == {0: 1.0, 1: 1.0}


def test_bubble_ratio_is_never_negative() -> None:
    """Float sums of durations can overshoot the span by an ulp; the ratio stays in [0, 1]."""
    costs = LayerCosts((0.0,), (4.0,), (0,))
    plan = Plan.from_stages([], range(0, 1), [], costs, 1, 4)
    result = simulate(plan, costs, 1, 4, 1, False, None, latency_ms=0.01, shared_link=False)
    assert result.bubble.per_device == {0: 0.0}
    assert result.bubble_ratio == 0.0


def test_order_is_per_lane_start_order(hand_made: Trace) -> None:
    order = hand_made.order()
    assert order["d0.compute"] == [("c0",), ("c2",)]
    assert order["d1.compute"] == [("c1",)]
    assert order["host.optimizer"] == [("st",)]
    assert set(order) == set(hand_made.lanes())
    shuffled = Trace(list(reversed(hand_made.records)))
    assert shuffled.order() == order


# --------------------------------------------------------------------- views


def test_perfetto_has_one_track_per_lane_per_device(fake_trace: Trace, tmp_path: Path) -> None:
    path = fake_trace.to_perfetto(tmp_path / "t.perfetto.json")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["device 0", "device 1", "device 2", "host"]
    tracks = [
        (names[e["pid"]], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"
    ]
    assert len(tracks) == len(set(tracks))  # one track each
    expected = {
        ("host" if t.device < 0 else f"device {t.device}", t.lane.split(".", 1)[1]) for t in fake_trace
    }
    assert set(tracks) == expected
    for d in range(3):  # every device used all five lanes
        assert {lane for dev, lane in tracks if dev == f"device {d}"} == {
            "compute",
            "act_up",
            "act_down",
            "param_up",
            "grad_down",
        }
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(fake_trace)
    tid_of = {
        (e["pid"], e["args"]["name"]): e["tid"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    pid_of = {v: k for k, v in names.items()}
    for e in complete:
        lane = e["args"]["lane"]
        device = "host" if lane.startswith("host") else f"device {lane[1:].split('.')[0]}"
        assert e["tid"] == tid_of[(pid_of[device], lane.split(".", 1)[1])]


def test_plot_writes_a_png(fake_trace: Trace, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = fake_trace.plot(tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000
