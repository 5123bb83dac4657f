"""The in-memory state of a run: what `RoundPipe.state_dict()` holds and how it is put back.

Why a module of its own: the state is a format other code relies on (`roundpipe.checkpoint`
writes it to disk piece by piece and rebuilds it on load), so its keys, its version tag and the
rules for putting it back belong in one place rather than among the facade's plumbing. The
facade decides *when* (after synchronizing, on an open pipe); this module says *what*. The
global RNG states a checkpoint saves beside it are captured and restored here too.

It must never touch the engine or the runtime, and never load a state into a model it does not
match (it refuses with the names that differ).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from roundpipe.config import RunConfig
from roundpipe.errors import ConfigError
from roundpipe.optim.host import HostModel, LossScaler
from roundpipe.sched.rules import deferred_p_copy
from roundpipe.sched.spec import ScheduleOptions

STATE_FORMAT = "roundpipe.state/1"


def capture_state(
    config: RunConfig, host: HostModel, scaler: LossScaler | None, step: int, iteration: int
) -> dict[str, Any]:
    """Weights (fp32), optimizer and scheduler state, counters, config, loss scaler, and in
    async mode the weights the next iteration will read (the P-copy still in flight). The host
    copies must be quiet (nothing in flight writes them)."""
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "config": config.model_dump(),
        "step": step,
        "iteration": iteration,
        "model": {name: master.detach().clone() for name, _, master in host.named_masters()},
        "host": host.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    if config.async_optimizer:
        state["in_flight_weights"] = {name: t.clone() for name, t in host.named_compute()}
    return state


def check_state(state: Any, config: RunConfig) -> None:
    """Refuse what is not a state of this format, or one saved in the other optimizer mode."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ConfigError("not a RoundPipe state_dict (missing or unknown 'format')")
    if bool(state["config"]["async_optimizer"]) != config.async_optimizer:
        raise ConfigError(
            "the state was saved with async_optimizer="
            f"{state['config']['async_optimizer']} but this pipe uses {config.async_optimizer}; "
            "resume with the same mode"
        )


def restore_host(
    state: dict[str, Any],
    host: HostModel,
    scaler: LossScaler | None,
    in_flight: bool,
    fresh_units: frozenset[int] = frozenset(),
) -> None:
    """Put a checked state's weights, optimizer, scheduler and scaler state into quiet host copies;
    gradients not yet stepped are dropped. ``in_flight``: this pipe's next iteration reads the
    version before the last step (its P-copy is deferred), so the compute copy gets the saved
    in-flight weights; otherwise (sync, or an async warm-up still running) the optimizer copy.
    The ``fresh_units`` read the newest weights either way: their compute copy is the optimizer's."""
    masters = {name: master for name, _, master in host.named_masters()}
    missing = set(masters) - set(state["model"])
    unexpected = set(state["model"]) - set(masters)
    if missing or unexpected:
        raise ConfigError(
            f"state_dict does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    with torch.no_grad():
        for name, master in masters.items():
            master.copy_(state["model"][name])
        host.load_state_dict(state["host"])
        host.drop_gradients()
        if in_flight and "in_flight_weights" in state:
            fresh = {id(p) for unit in fresh_units for p in host.unit_params.get(unit, ())}
            stale = {name for name, param, _ in host.named_masters() if id(param) not in fresh}
            compute = dict(host.named_compute())
            for name, tensor in state["in_flight_weights"].items():
                if name in stale:
                    compute[name].copy_(tensor)
            for unit in fresh_units:
                host.p_copy(unit)
        else:
            host.p_copy_all()
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


def compute_copy_version(step: int, options: ScheduleOptions) -> int:
    """The weight version the compute copy holds after a restore at ``step``: in async mode the
    weights before the last step (version step-1: its P-copy was deferred), otherwise (sync, or
    still in the async warm-up) those after it."""
    deferred = deferred_p_copy(step - 1, options.async_optimizer, options.sync_steps)
    return step - 1 if deferred and step > 0 else step


def rng_state() -> dict[str, Any]:
    """The global torch (and CUDA, once initialised) and Python RNG states, for a checkpoint: a
    resumed run draws the same numbers (dropout, data order) as one that never stopped."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
