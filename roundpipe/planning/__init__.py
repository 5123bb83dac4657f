"""Plan evaluation: choosing, timing and re-choosing the plan a run executes.

Why a package between the planner and the facade: `roundpipe.plan` proposes candidate plans from
cost formulas and knows nothing of the engine; the plan that runs is the one with the shortest
evaluated iteration, and evaluating needs the real engine on the fake backend (`simulate`) or its
exact max-plus replay (`replay`, `replay_graph`, `replay_rule`). `ranking` times candidates that
way, `device_plan` plans within a device's memory budget from measured layers and re-plans from
measured times, and `link_plan` reshapes a plan whose uploads outlast compute. `RoundPipe` hands
all of it here and only applies the result.

This ``__init__`` imports nothing: simulation and the schedule commands must load without torch
or pydantic (tests/test_layering.py), which `device_plan` needs. Nothing in `roundpipe.plan`,
`roundpipe.sched` or `roundpipe.backends` may import this package.
"""
