"""An integration whose framework is missing says which extra installs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from crashproof.errors import ConfigError
from crashproof.integrations._requires import require


def test_a_missing_framework_names_the_extra_to_install() -> None:
    with pytest.raises(ConfigError, match=r"pip install 'crashproof\[lightning\]'"):
        require("no_such_framework_here", extra="lightning", what="crashproof.integrations.x")


def test_import_crashproof_imports_no_framework() -> None:
    code = (
        "import sys, crashproof, crashproof.integrations; "
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate', 'datasets') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
