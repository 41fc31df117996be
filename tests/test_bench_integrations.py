"""benchmarks/integrations.py still runs: a smoke run at the smallest sizes (no speed asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "integrations.py"


def test_quick_run_reports_both_loops(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--n-embd", "32", "--n-layer", "1",
         "--vocab", "256", "--seq", "8", "--steps", "4", "--every", "2", "--warmup", "0",
         "--dir", str(tmp_path), "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    for loop, own in (("HF Trainer", "the Trainer's own"), ("Lightning", "Lightning's own")):
        for label in (own, "crashproof"):
            (row,) = [r for r in rows if r.startswith(f"| {loop} | {label}")]
            cells = [c.strip() for c in row.strip("|").split("|")]
            saves, blocking, wall = float(cells[2]), float(cells[3]), float(cells[7])
            assert saves == 2, row  # steps 2 and 4
            assert blocking > 0 and wall > 0, row
        (ratio,) = re.findall(rf"- {loop}: crashproof blocks \*\*([0-9.]+)x\*\*", done.stdout)
        assert float(ratio) > 0
    assert (tmp_path / "out.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # its scratch is removed
