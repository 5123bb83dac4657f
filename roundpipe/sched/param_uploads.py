"""A stage run's parameter uploads: one task per layer, or per part of a large layer.

Why apart from the builder: what an upload waits for is three separate concerns, each with its
reason, and the builder only relates runs. Each part waits for:
  - the run ``prefetch_stages`` + 1 before on the device (completed): one stage of prefetch, so a
    device holds at most that many stages' weights beyond the one it computes;
  - the P-copy that wrote the weight version it reads (rule 2, `rules.no_torn_weights`);
  - with ``ScheduleOptions.upload_parts_ahead`` set, the part that many before it in the run
    (completed). Off by default until a GPU has measured it.

The last is flow control on the link. If a GPU's copy engine serves the host-to-device copies of all
streams about in the order they reach it, an activation upload that becomes ready waits behind every
parameter part already handed over. In traces of workload E on one H100 (`roundpipe trace gaps`, the
traces of `gpu_big.sh E` and `E-inputs`), every input or gradient upload that started more than 2 ms
after it could (65 of 448, and 50 of 400) did so while parameter parts were on the link for
99.7-99.8% of that wait, up to 44 ms (in those forward runs the link is that busy anyway). A run's
upload issued whole puts ~100 parts of 64 MiB in that queue; with eight in flight an activation
waits behind at most ~10 ms of them, while the host has as long to issue the next part. On the fake
stream backend with all uploads in one queue (`python bench/upload_order.py`), E's remaining 5.6%
bubble goes to 0 and D's iteration (`python bench/flow_depth.py --parts-ahead 8`) from 2,973
to 2,506 ms. Not yet measured on a GPU, where the cost is the host's: each part is issued only once
the one eight before has completed, so a host late to issue leaves the link idle, and D's link is
busy 97% of its step. One doubt: in those traces an input upload that started late ran beside a
parameter part, not after one, so the copy engine may not be strictly first come, first served
(`bench/gpu_big.sh E-parts8` measures it).

This module must never hold tensors or decide anything but these tasks and their dependencies.
"""

from __future__ import annotations

from roundpipe.sched import rules
from roundpipe.sched.keys import ParamUpKey
from roundpipe.sched.rules import UnitLedger
from roundpipe.sched.spec import ModelSpec, ScheduleOptions
from roundpipe.sched.stage_run import IterationInProgress, StageRun
from roundpipe.sched.task import PARAM_UP, Key


def param_uploads(
    run: StageRun,
    built: IterationInProgress,
    spec: ModelSpec,
    options: ScheduleOptions,
    ledgers: dict[int, UnitLedger],
    history: list[Key] | tuple[()],
    base_versions: tuple[int, int],
) -> list[Key]:
    """Append ``run``'s upload parts to ``built``, in layer order; return their keys.
    ``history``: the device's runs so far (their last computes); ``base_versions``: the weight
    version already in the compute copy, of the stale units and of the fresh ones."""
    back = options.prefetch_stages + 1
    prefetch_dep = [history[-back]] if len(history) >= back else []
    chunk, window = options.chunk_bytes, options.upload_parts_ahead
    param_keys: list[Key] = []
    for layer in run.layers:
        nbytes, owners = spec.param_bytes[layer], spec.owners[layer]
        if nbytes <= 0 and not owners:
            continue  # nothing to upload and no weight version to wait for
        parts = 1 if not chunk else max(1, -(-nbytes // chunk))
        deps: list[Key] = list(prefetch_dep)
        is_fresh = bool(owners) and owners[0] in options.fresh_units  # all owners or none
        version = built.step if is_fresh else built.version  # fresh: the step's own weights
        base = base_versions[1] if is_fresh else base_versions[0]
        for unit in owners:
            deps += rules.no_torn_weights(ledgers[unit], version, base)
        for part in range(parts):
            key = ParamUpKey(run.iteration, run.round, run.slot, layer, part)
            part_bytes = nbytes // parts + (1 if part < nbytes % parts else 0)
            ahead = [param_keys[-window]] if window and len(param_keys) >= window else []
            built.tasks.append(
                run.task(
                    key,
                    PARAM_UP,
                    deps + ahead,
                    layers=range(layer, layer + 1),
                    step=version,
                    part=part,
                    num_parts=parts,
                    nbytes=part_bytes,
                    sync_deps=prefetch_dep + ahead,
                )
            )
            param_keys.append(key)
            for unit in owners:
                ledgers[unit].readers.setdefault(version, []).append(key)
    return param_keys
