"""The on-disk format: the names in a root, the manifest, each rank's index and tensor file,
the state tree as JSON, checksums, dtypes, and the limits on what is read (and on the
metadata a caller passes). Saving and restoring both build on it; it knows neither.
"""

from __future__ import annotations

from crashproof.checkpoint.format._dtypes import dtype_from_name, dtype_name, safetensors_code
from crashproof.checkpoint.format._fields import (
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_STEP,
    dumps,
)
from crashproof.checkpoint.format._hashing import HASH_ALGORITHM, digest, new_hasher
from crashproof.checkpoint.format._manifest import (
    FileEntry,
    Manifest,
    parse_manifest,
    seal_manifest,
)
from crashproof.checkpoint.format._names import (
    MANIFEST_NAME,
    checkpoint_dir_name,
    index_name,
    parse_step_dir,
    shard_name,
)
from crashproof.checkpoint.format._parts import held_part, part_files
from crashproof.checkpoint.format._pieces import Piece, sharded_pieces
from crashproof.checkpoint.format._rank_index import (
    DeltaEntry,
    RankIndex,
    TensorEntry,
    UnlistedShardError,
    parse_rank_index,
)
from crashproof.checkpoint.format._shard_file import (
    ReadBuffer,
    ShardRead,
    copy_tensor_bytes,
    shard_layout,
    tensor_bytes,
    write_shard,
)
from crashproof.checkpoint.format._state_tree import (
    JSONValue,
    decode_tree,
    encode_tree,
    tensor_references,
)
from crashproof.checkpoint.format._user_metadata import checked_metadata

__all__ = [
    "HASH_ALGORITHM",
    "MANIFEST_NAME",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_STEP",
    "DeltaEntry",
    "FileEntry",
    "JSONValue",
    "Manifest",
    "Piece",
    "RankIndex",
    "ReadBuffer",
    "ShardRead",
    "TensorEntry",
    "UnlistedShardError",
    "checked_metadata",
    "checkpoint_dir_name",
    "copy_tensor_bytes",
    "decode_tree",
    "digest",
    "dtype_from_name",
    "dtype_name",
    "dumps",
    "encode_tree",
    "held_part",
    "index_name",
    "new_hasher",
    "parse_manifest",
    "parse_rank_index",
    "parse_step_dir",
    "part_files",
    "safetensors_code",
    "seal_manifest",
    "shard_layout",
    "shard_name",
    "sharded_pieces",
    "tensor_bytes",
    "tensor_references",
    "write_shard",
]
