"""The documents run as written.

Every shell block of README.md and docs/*.md is read the way a user copies it:

* every ``crashproof ...`` command in it must parse with the real command line (the options
  exist, their values are accepted; ``crashproof chaos``'s ``crashproof run`` arguments too);
* a block marked ``<!-- runnable -->`` on the line before it is run, in a temporary directory
  where ``examples/`` is the repository's, and must exit 0; when the block right after it is
  marked ``<!-- output -->``, that is what it must print, exactly.

Python blocks must compile. So a renamed option, a changed default or a reworded table cannot
leave the documents behind.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from crashproof.cli import build_parser
from crashproof.cli._run import build_run_parser
from tests.conftest import REPO

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str
    runnable: bool
    output: str | None
    """The text of the ``<!-- output -->`` block that follows a runnable block."""

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[tuple[int, str, str, str]] = []  # (line, lang, text, marker before it)
    i = 0
    while i < len(lines):
        match = re.match(r"^```(\w*)\s*$", lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = lines[i - 1].strip() if i > 0 else ""
        found.append((i + 1, match.group(1), "\n".join(lines[i + 1 : end]), marker))
        i = end + 1
    result = []
    for n, (line, lang, text, marker) in enumerate(found):
        after = found[n + 1] if n + 1 < len(found) else None
        output = after[2] if after is not None and after[3] == "<!-- output -->" else None
        result.append(Block(path, line, lang, text, marker == "<!-- runnable -->", output))
    return result


ALL = [b for path in DOCUMENTS for b in blocks(path)]
SHELL = [b for b in ALL if b.lang in ("bash", "sh", "shell")]
PYTHON = [b for b in ALL if b.lang == "python"]


def commands(block: Block) -> list[list[str]]:
    """The ``crashproof`` commands of a shell block, continuation lines joined, comments gone."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["crashproof"]:
            found.append(words[1:])
    return found


def test_the_documents_have_shell_blocks_and_some_are_run() -> None:
    assert len(SHELL) >= 10 and sum(b.runnable for b in SHELL) >= 5


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_every_crashproof_command_shown_parses(block: Block) -> None:
    for argv in commands(block):
        where = f"{block}: crashproof {shlex.join(argv)}"
        try:
            if argv[0] == "run":
                build_run_parser().parse_args(argv[1:])
            else:
                args = build_parser().parse_args(argv)
                if argv[0] == "chaos":
                    run_args = [a for a in args.run_args if a != "--"]
                    build_run_parser().parse_args(run_args)
        except SystemExit as exc:
            pytest.fail(f"{where}: does not parse (exit {exc.code})")


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.text, str(block), "exec")


@pytest.mark.parametrize("block", [b for b in SHELL if b.runnable], ids=str)
def test_runnable_blocks_run_as_written(block: Block, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    said = f"{block} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    if block.output is not None:
        assert proc.stdout.rstrip("\n") == block.output.rstrip("\n"), said
