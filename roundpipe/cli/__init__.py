"""The ``roundpipe`` command line: the dispatcher (`main`) and every subcommand, in one package.

Each command module registers its subcommands with the dispatcher (`roundpipe.cli.main`):
``plan``/``simulate``/``trace`` (`plan_commands`, printed by `plan_report`), ``train``
(`train_command`), ``checkpoint verify`` (`checkpoint_commands`) and ``export`` (`export_command`).
Importing this package, or any command module, must never import torch or pydantic beyond what a
parser needs: ``roundpipe --help``, ``plan``, ``simulate`` and ``trace`` run where torch is not
installed (tests/test_layering.py).
"""

from __future__ import annotations

from roundpipe.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
