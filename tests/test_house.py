"""The repository speaks of the product, not of how it was made.

Why: comments, docstrings and docs that narrate working periods (which one changed a constant,
what the last one found, which issue number asked for a target) go stale the moment they are written and tell a reader nothing that
holds; what changed when belongs in git log. So every tracked text file of the package, its tests,
docs, benchmarks and examples is searched for the words that such narration needs, and the
performance page is held to the current figures (at most ``PERFORMANCE_MAX_LINES`` lines).

Sizes are a house rule of the same kind (docs/design.md, "Sizes"): every module under
``roundpipe/`` is measured in lines and every function from its ``def`` to its last line, and
anything over the limits fails unless it is one of the few named in ``SIZE_EXCEPTIONS``.

The patterns are kept precise, so ordinary English passes: ordinals up to "tenth" are common
("a tenth faster", "an eighth of the budget", "the second iteration") and are not searched for;
the ordinals past ten, the word for a working period, and an issue or pull request number are. The words are assembled from pieces so that this file does not find itself.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("roundpipe", "tests", "docs", "bench", "examples", "README.md")
SUFFIXES = {".py", ".md", ".c", ".toml", ".sh", ".yml", ".yaml", ".json"}
# Data, not prose: a tokenizer's vocabulary may hold any word.
NOT_PROSE = {"roundpipe/data/tokenizer/tokenizer.json"}
PERFORMANCE_MAX_LINES = 600
MODULE_MAX_LINES = 400
FUNCTION_MAX_LINES = 60
# "file:function" -> why it stays whole. At most three entries, each named in docs/design.md.
SIZE_EXCEPTIONS = {
    # The Python twin of `stream_loop` in plan/_kernels.c, compared step for step by
    # tests/test_native_kernels.py: split, the two would differ in structure.
    "roundpipe/plan/_event_loop.py:event_loop": "the Python twin of the C stream_loop",
}
# pytest's own API names its test run so; these exact uses are code, not narration.
_WORD = "sess" + "ion"
ALLOWED = re.compile(rf'scope="{_WORD}"|request\.{_WORD}\b|\b{_WORD}: pytest\.{_WORD.capitalize()}\b')

_PERIOD = "sess" + "ions?"
_ORDINALS = "eleven|twelf|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twentie|thirtie"
NARRATION = re.compile(
    rf"\b{_PERIOD}\b"  # the word for a working period, in any use
    rf"|\b(?:{_ORDINALS})th\b"  # ordinals past ten: only working periods were counted that far
    r"|\b(?:twenty|thirty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)\b"
    r"|\b(?:issue|pull request|PR)s? ?#?\d+\b",  # an issue or pull request by number, as history
    re.IGNORECASE,
)


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *SEARCHED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = [n for n in listed.stdout.split("\0") if n]
    return [
        ROOT / n for n in names if Path(n).suffix in SUFFIXES and n not in NOT_PROSE and (ROOT / n).is_file()
    ]


def narration_in(text: str) -> list[tuple[int, str]]:
    """The (line number, matched words) of every line of ``text`` that narrates how it was made."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        hits = [m.group(0) for m in NARRATION.finditer(ALLOWED.sub("", line))]
        if hits:
            found.append((number, ", ".join(hits)))
    return found


def test_no_file_narrates_how_it_was_made() -> None:
    found = []
    for path in _tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(ROOT)
        found.extend(f"{rel}:{number}: {words}" for number, words in narration_in(text))
    assert not found, "state what holds and why; what changed when belongs in git log:\n" + "\n".join(found)


def test_the_pattern_finds_narration_and_passes_ordinary_english() -> None:
    period = "sess" + "ion"
    narrated = [
        f"10N was 8N until the six{'teenth'} {period}",
        f"measured in the last {period}",
        f"{period}s of work",
        f"a section headed Twen{'tieth'} findings",
        "the target of iss" + "ue 8",
        "as asked (iss" + "ue #12)",
        "twenty" + "-first",
    ]
    for line in narrated:
        assert narration_in(line), line
    ordinary = [
        "the first iteration compiles, so re-plan from the second",
        "an eighth of the budget, at least 192 MiB",
        "about a tenth faster than with 2**40",
        "a third of a choice's time",
        "the fifth step on",
        "issued ahead; device-side waits",
        "the issue time of a task",
        "a TSV file of 8 columns",
        f'@pytest.fixture(scope="{period}")',
        f"items = request.{period}.items",
        f"def pytest_collection_finish({period}: pytest.{period.capitalize()}) -> None:",
    ]
    for line in ordinary:
        assert not narration_in(line), line


def test_the_performance_page_holds_the_current_figures_only() -> None:
    lines = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= PERFORMANCE_MAX_LINES, (
        f"docs/performance.md has {len(lines)} lines, more than {PERFORMANCE_MAX_LINES}: keep the "
        "current figures with their commands, machines and limits; history belongs in git log"
    )


def oversized(source: str, rel: str) -> list[tuple[str, int]]:
    """("file:function" or "file", length in lines) of everything in ``source`` over the limits;
    nested functions and methods are named by their dotted path."""
    found: list[tuple[str, int]] = []
    lines = len(source.splitlines())
    if lines > MODULE_MAX_LINES:
        found.append((rel, lines))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > FUNCTION_MAX_LINES:
                    found.append((f"{rel}:{name}", length))
            visit(child, name)

    visit(ast.parse(source), "")
    return found


def test_every_module_and_function_is_within_the_size_limits() -> None:
    assert len(SIZE_EXCEPTIONS) <= 3, "at most three named exceptions: split the rest"
    measured: dict[str, int] = {}
    for path in sorted((ROOT / "roundpipe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        measured.update(oversized(path.read_text(encoding="utf-8"), rel))
    over = [f"{name}: {length} lines" for name, length in measured.items() if name not in SIZE_EXCEPTIONS]
    assert not over, (
        f"modules are at most {MODULE_MAX_LINES} lines and functions at most {FUNCTION_MAX_LINES}; "
        "split these by role:\n" + "\n".join(over)
    )
    stale = sorted(set(SIZE_EXCEPTIONS) - set(measured))
    assert not stale, f"within the limits now, drop from SIZE_EXCEPTIONS and docs/design.md: {stale}"


def test_the_size_measure_names_file_function_and_length() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_MAX_LINES))
    source = f"class C:\n    def small(self) -> None:\n        pass\n\n    def big(self) -> None:\n{body}\n"
    indented = source.replace("\n    x", "\n        x")
    assert oversized(indented, "m.py") == [("m.py:C.big", FUNCTION_MAX_LINES + 1)]
    assert oversized("x = 1\n" * (MODULE_MAX_LINES + 1), "m.py") == [("m.py", MODULE_MAX_LINES + 1)]
    assert oversized("def f() -> None:\n" + "    pass\n" * (FUNCTION_MAX_LINES - 1), "m.py") == []
