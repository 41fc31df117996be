"""Export to standard formats (safetensors, ``torch.distributed.checkpoint``), and where an
export may write.
"""

from __future__ import annotations

from crashproof.checkpoint.export._export import export_dcp, export_safetensors
from crashproof.checkpoint.export._target import check_target

__all__ = [
    "check_target",
    "export_dcp",
    "export_safetensors",
]
