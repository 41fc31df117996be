"""Export to standard formats (safetensors, ``torch.distributed.checkpoint``, a Hugging Face
``save_pretrained`` directory), and where an export may write.
"""

from __future__ import annotations

from crashproof.checkpoint.export._export import export_dcp, export_safetensors
from crashproof.checkpoint.export._hf import HF_CONFIG, HF_GENERATION_CONFIG, HfExport, export_hf
from crashproof.checkpoint.export._target import check_target

__all__ = [
    "HF_CONFIG",
    "HF_GENERATION_CONFIG",
    "HfExport",
    "check_target",
    "export_dcp",
    "export_hf",
    "export_safetensors",
]
