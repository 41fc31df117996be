"""``python -m crashproof.cli``: the ``crashproof`` command, for an install without its scripts."""

from __future__ import annotations

import sys

from crashproof.cli import main

sys.exit(main())
