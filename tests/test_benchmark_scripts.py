"""Every script in ``benchmarks/`` still loads: a helper renamed in one benchmark must not leave
another broken until somebody runs it. (Each is imported, not run: running them is their own
business, minutes each; the short versions of what they measure are tests elsewhere.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_the_benchmark_loads_and_has_a_main(script: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(module)  # (its imports: a name gone from a helper fails here)
    finally:
        del sys.modules[spec.name]
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
