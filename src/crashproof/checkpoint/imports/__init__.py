"""Checkpoints from elsewhere brought into a crashproof root: ``torch.save`` files (a state dict,
a training loop's dict, a Lightning ``.ckpt``), safetensors files and Hugging Face
``save_pretrained`` / ``Trainer`` directories, read without running code from them and written as
a committed crashproof checkpoint a ``TrainState`` restore loads (docs/importing.md).
"""

from __future__ import annotations

from crashproof.checkpoint.imports._foreign import Foreign
from crashproof.checkpoint.imports._import import Imported, import_checkpoint, read_source

__all__ = ["Foreign", "Imported", "import_checkpoint", "read_source"]
