"""The README's commands as a newcomer types them: CI runs exactly its test command, the set-up
commands pin torch (a bare ``pip install torch`` pulls a multi-GB CUDA build, and an index URL
in a command fails where that index is unreachable), and no example writes into the clone."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
MARKER = "# --- the README's test command ---"


def bash_lines() -> list[str]:
    """Every command line of the README's bash blocks (continuations joined, comments cut)."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #", 1)[0].strip()
            if command:
                lines.append(command)
    return lines


def test_ci_runs_exactly_the_readme_test_command() -> None:
    after = README.split("Run the tests:", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", after, flags=re.S)
    assert command is not None
    script = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert script[script.index(MARKER) + 1] == command.group(1).strip()


def test_every_install_of_torch_pins_it_and_names_no_index() -> None:
    installs = [line for line in bash_lines() if "pip install" in line]
    assert installs
    for line in installs:
        assert "--index-url" not in line and "download.pytorch.org" not in line, line
        if re.search(r"\btorch\b", line):
            assert re.search(r"torch==\d", line), line
    # both set-up commands bring torch with them (a fresh machine has none)
    assert any("roundpipe train" in line and "torch==" in line for line in installs)
    assert any("pytest" in line and "torch==" in line for line in installs)


def test_no_example_writes_into_the_clone() -> None:
    for line in bash_lines():
        for flag in ("--png", "--perfetto", "--trace"):
            match = re.search(rf"{flag}(?:\s+(\S+))?", line)
            if match and match.group(1) and not match.group(1).startswith("-"):
                assert match.group(1).startswith(("runs/", "/tmp/")), line
