"""CPU math that gives the same bits on every run: Intel MKL's settings.

PyTorch's CPU wheels do matrix products with MKL. By default MKL may use fewer threads than asked
when the machine is busy (``MKL_DYNAMIC``) and may pick code paths by the memory alignment of the
operands; either changes the order of the sums, so two runs of the same script can differ in the
last bits (seen: ``make demo`` failing in 2 of about 12 runs, the loss differing at step 6 before any
checkpoint). ``MKL_DYNAMIC=FALSE`` and ``MKL_CBWR=AUTO,STRICT`` (the fastest code path this CPU
has, the same result every run) remove both. MKL reads them once, when it is loaded, so they must
be in the environment before ``import torch``: ``crashproof run`` sets them for its trainers
unless the user set them; :func:`mkl_reproducible` says whether this process has them.
"""

from __future__ import annotations

import os

__all__ = ["MKL_REPRODUCIBLE_ENV", "mkl_reproducible", "set_reproducible_defaults"]

MKL_REPRODUCIBLE_ENV = {"MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}


def set_reproducible_defaults(env: dict[str, str] | None = None) -> None:
    """Put the settings into ``env`` (default ``os.environ``, inherited by processes started
    after this), keeping any value the user chose."""
    target = os.environ if env is None else env
    for key, value in MKL_REPRODUCIBLE_ENV.items():
        target.setdefault(key, value)


def mkl_reproducible() -> bool:
    """Whether this process's environment asks MKL for run-to-run reproducible results."""
    cbwr = os.environ.get("MKL_CBWR", "").upper()
    dynamic = os.environ.get("MKL_DYNAMIC", "").upper()
    return ("STRICT" in cbwr or cbwr.startswith("COMPAT")) and dynamic in ("FALSE", "0", "NO")
