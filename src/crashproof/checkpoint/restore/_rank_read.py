"""Read and verify committed checkpoints. Nothing here unpickles or follows a path out of the directory.

Every read is bounded by what the manifest promises and the manifest is bounded by a size limit,
so corrupt or hostile input ends in :class:`CorruptCheckpointError`, never in a huge allocation,
an out-of-bounds read or code execution. This module owns the reading of a rank's tensors and
state (:class:`RankRead`), which restore and :func:`verify_checkpoint` share; the manifest and the
ranks' indexes are read by :mod:`crashproof.checkpoint.restore._read_manifest`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from typing import Any

import torch

from crashproof.checkpoint.format import (
    Manifest,
    RankIndex,
    ReadBuffer,
    ShardRead,
    TensorEntry,
    checkpoint_dir_name,
    decode_tree,
    digest,
    dtype_from_name,
    dtype_name,
    held_part,
    index_name,
    sharded_pieces,
    tensor_references,
)
from crashproof.checkpoint.restore._read_manifest import (
    read_error,
    read_manifest,
    read_manifest_bytes,
    read_rank_index,
    refused,
)
from crashproof.checkpoint.save import apply_delta
from crashproof.errors import CorruptCheckpointError, StateMismatchError
from crashproof.state import check_structure, value_tensor_names
from crashproof.storage import ReadStream, Storage

__all__ = [
    "RankRead",
    "load_rank_state",
    "verify_checkpoint",
]


class RankRead:
    """One rank's part of a checkpoint, read in steps the restore can interleave with its checks.

    1. construction: the index parsed, a full checkpoint listing no deltas, each tensor referred
       to once by the state, and a live destination only where the state refers to it from its
       own name's place;
    2. :meth:`verify`: every byte checked against its checksum (raises on corruption), every
       tensor without a live destination read into memory (``keep``), and those with one too as
       far as ``buffer`` allows (each byte then read once); :meth:`check_tree` then gives the
       tree with the real values of the former (tensors with a live destination, or not kept,
       are stand-ins), for the checks and trial loads that need values;
    3. :meth:`finish`: tensors with a live destination in ``into`` copied into it from the
       buffer, or read straight into it (a second read), and the state tree returned.

    Live destinations never share memory (tied weights, an EMA module sharing a parameter with
    the model): of tensors that overlap, only the first is a destination, the others are read
    into new memory (the load copies them), so each live byte is written, and each delta
    applied to it, once.

    A delta checkpoint's rank also reads its base's rank, which must be the very checkpoint the
    delta was taken against (checked on construction, from the manifests and indexes). Step 2
    verifies the base too and rebuilds every encoded tensor, checking it against the checksum of
    the tensor that was saved: one without a live destination in place of the base's copy read
    into memory (that is its value), one with a live destination into scratch memory; step 3
    then reads the base's tensors into the live destinations and applies the deltas to them in
    place (checked once more).

    Restore and :func:`verify_checkpoint` run these same steps: there is one validation path.
    """

    def __init__(
        self,
        storage: Storage,
        ckpt_dir: str,
        manifest: Manifest,
        rank: int,
        *,
        into: Mapping[str, Any] | None = None,
        keep: bool | Callable[[str], bool] = True,
        on_bytes: Callable[[int], None] | None = None,
        buffer: ReadBuffer | None = None,
        base: Manifest | None = None,
    ) -> None:
        self._index = read_rank_index(storage, ckpt_dir, manifest, rank)
        self._index_where = storage.describe(storage.join(ckpt_dir, index_name(rank)))
        self.shard_file = self._index.shard_file
        self._where = storage.describe(storage.join(ckpt_dir, self.shard_file))
        self._base: RankRead | None = None
        self._keep = keep
        self._rebuilt: dict[int, torch.Tensor] = {}  # delta tensors rebuilt by verify(), by index
        if manifest.kind != "delta" and self._index.deltas:
            # Never applied, but it would make the checks see a stand-in where the load sees
            # the stored bytes: a full checkpoint has nothing to rebuild.
            raise CorruptCheckpointError(
                f"{self._index_where}: a {manifest.kind} checkpoint's index lists deltas"
            )
        self._references = _references(self._index, self._index_where)
        bound = _bound(into or {}, self._index, self._references)
        into = _distinct_memory(bound)
        self._check_ties(bound, into)
        if manifest.kind == "delta":
            self._base = self._open_base(
                storage, ckpt_dir, manifest, rank, into, keep, on_bytes, buffer, base
            )
            keep = True  # the encoded bytes are needed to rebuild the tensors
            # An encoded tensor is a blob of bytes, never read into the live tensor of its name.
            encoded = {self._index.tensors[d.index].name for d in self._index.deltas}
            into = {k: v for k, v in (into or {}).items() if k not in encoded}
        # This rank's shard, and the tensors it finds in other ranks' shards (replicated state
        # written once, spread over the ranks), each file read by one ShardRead.
        by_file: dict[str, list[int]] = {self.shard_file: []}
        for i, entry in enumerate(self._index.tensors):
            by_file.setdefault(entry.file or self.shard_file, []).append(i)
        self._parts: list[tuple[list[int], ShardRead, ReadStream]] = []
        try:
            for file, positions in by_file.items():
                where = storage.describe(storage.join(ckpt_dir, file))
                try:
                    stream = storage.open(storage.join(ckpt_dir, file))
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{where}: missing") from None
                except OSError as exc:
                    raise refused(exc, where) from None
                part = ShardRead(
                    stream, [self._index.tensors[i] for i in positions], manifest.files[file],
                    where, into=into, keep=keep, on_bytes=on_bytes,
                    partial=file != self.shard_file, buffer=buffer,
                )  # fmt: skip
                self._parts.append((positions, part, stream))
        except BaseException:
            self.close()
            raise

    def _check_ties(self, bound: Mapping[str, Any], kept: Mapping[str, Any]) -> None:
        """Live tensors that are one memory (tied weights) must have been saved as one value:
        a checkpoint of a model without the tie holds two, and loading both into one memory
        would keep either silently. Judged by the saved tensors' checksums (of the whole tensor,
        for a delta), before anything is read."""
        saved = {e.name: e.checksum for e in self._index.tensors}
        for delta in self._index.deltas:
            saved[self._index.tensors[delta.index].name] = delta.checksum
        owners = {_memory_span(t): name for name, t in kept.items()}
        for name, tensor in bound.items():
            owner = owners.get(_memory_span(tensor))
            if name in kept or owner is None or name not in saved or owner not in saved:
                continue
            if (
                saved[name] != saved[owner]
                and tensor.shape == kept[owner].shape
                and tensor.dtype == kept[owner].dtype
            ):
                raise StateMismatchError(
                    f"{self._index_where}: {owner!r} and {name!r} are one tensor in the live "
                    "model (tied weights), but the checkpoint holds two different values for "
                    f"them (checksums {saved[owner]} and {saved[name]}): it was saved from a "
                    "model without that tie. Tie (or untie) them as in the run that saved it."
                )

    def _open_base(
        self,
        storage: Storage,
        ckpt_dir: str,
        manifest: Manifest,
        rank: int,
        into: Mapping[str, Any] | None,
        keep: bool | Callable[[str], bool],
        on_bytes: Callable[[int], None] | None,
        buffer: ReadBuffer | None,
        base: Manifest | None,
    ) -> RankRead:
        """The base's rank, its live destinations limited to the tensors the deltas rebuild.

        The base must be the very checkpoint the delta was taken against (:func:`base_manifest`;
        ``base``, its manifest when the caller read and checked it already), and must hold every
        tensor a delta rebuilds with the delta's shape and dtype: checked from metadata, before
        a tensor byte is read."""
        if base is None:
            base_dir, base = base_manifest(storage, ckpt_dir, manifest)
        else:
            base_dir = _base_dir(storage, ckpt_dir, manifest)
        try:
            rebuilt = {self._index.tensors[d.index].name for d in self._index.deltas}
            base_into = {k: v for k, v in (into or {}).items() if k in rebuilt}
            reader = RankRead(
                storage, base_dir, base, rank,
                into=base_into, keep=keep, on_bytes=on_bytes, buffer=buffer,
            )  # fmt: skip
        except CorruptCheckpointError as exc:
            raise unusable_base(storage, ckpt_dir, manifest, exc) from None
        try:
            self._check_deltas_fit(reader._index)
        except BaseException:
            reader.close()
            raise
        return reader

    def _check_deltas_fit(self, base: RankIndex) -> None:
        """Every delta names a base tensor of its shape and dtype; a ``same`` one, its checksum."""
        by_name = {e.name: e for e in base.tensors}
        for delta in self._index.deltas:
            name = self._index.tensors[delta.index].name
            entry = by_name.get(name)
            if entry is None or entry.shape != delta.shape or entry.dtype != delta.dtype:
                found = "none" if entry is None else f"{entry.dtype}{list(entry.shape)}"
                raise CorruptCheckpointError(
                    f"{self._index_where}: tensor {name!r} is a delta of a "
                    f"{delta.dtype}{list(delta.shape)} tensor, the base holds {found}; the base "
                    "is not the checkpoint the delta was taken against"
                )
            if delta.encoding == "same" and entry.checksum != delta.checksum:
                raise CorruptCheckpointError(
                    f"{self._index_where}: tensor {name!r} is recorded unchanged since the base, "
                    f"with checksum {delta.checksum}; the base's has checksum {entry.checksum}: "
                    "the base is not the checkpoint the delta was taken against"
                )

    @property
    def index(self) -> RankIndex:
        """This rank's parsed, verified index."""
        return self._index

    sharded_values: Mapping[str, torch.Tensor] | None = None
    """The sharded tensors restored for this rank (by :mod:`crashproof.checkpoint.restore._dcp_reader`), for :meth:`finish`."""

    def sharded_entries(self) -> dict[str, TensorEntry]:
        """This rank's pieces of sharded tensors, by name (see :mod:`crashproof.checkpoint.restore._dcp_reader`)."""
        return {e.name: e for e in self._index.tensors if e.global_shape is not None}

    def verify(self) -> None:
        try:
            for _, part, _ in self._parts:
                part.verify()
        except (OSError, EOFError) as exc:
            raise read_error(exc, self._where) from None
        if self._base is not None:
            try:
                self._base.verify()
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(
                    f"{self._where}: the base of this delta is corrupt ({exc}); every delta on "
                    "that base is unusable"
                ) from None
            self._verify_rebuilt()

    def _verify_rebuilt(self) -> None:
        """Rebuild every encoded tensor into scratch memory, one at a time, and check it against
        its recorded checksum: :meth:`finish` writes into the live tensors only what rebuilt
        right here. (``same`` ones were checked from metadata.)"""
        assert self._base is not None
        blobs: dict[int, torch.Tensor] = {}
        for positions, part, _ in self._parts:
            blobs.update(zip(positions, part.kept(), strict=True))
        try:
            for delta in self._index.deltas:
                name = self._index.tensors[delta.index].name
                value = self._base._kept(name)
                if value is not None:  # no live destination: rebuilt where it was read, kept
                    if delta.encoding != "same":
                        apply_delta(
                            delta, blobs[delta.index], value, f"{self._where}: tensor {name!r}"
                        )
                    self._rebuilt[delta.index] = value
                    continue
                if delta.encoding == "same":
                    continue
                scratch = self._base._read_verified(name)
                apply_delta(delta, blobs[delta.index], scratch, f"{self._where}: tensor {name!r}")
        except (OSError, EOFError) as exc:
            raise read_error(exc, self._where) from None

    def _kept(self, name: str) -> torch.Tensor | None:
        """After :meth:`verify`: tensor ``name`` as read into memory, or None where it has a
        live destination (or is not kept)."""
        for positions, part, _ in self._parts:
            for at, i in enumerate(positions):
                if self._index.tensors[i].name == name:
                    return part.kept()[at] if part.has_value(at) else None
        return None

    def check_tree(self) -> Any:
        """After :meth:`verify`: the state tree with the verified value of every tensor that has
        no live destination (optimizer state, RNG states, extras' tensors; a delta's rebuilt),
        and a ``meta`` stand-in for each that has one (verified, not written yet), for sharded
        tensors (their whole shape) and for those not kept (``keep``). The restore checks and
        trial-loads this tree before anything live changes; :meth:`finish` later decodes the
        same values. A tensor is a live destination only where the state refers to it from
        its own name's place (see :func:`_bound`), so a stand-in stands exactly where the load
        will read the live tensor."""
        values: dict[int, torch.Tensor] = {}
        for positions, part, _ in self._parts:
            for at, (i, tensor) in enumerate(zip(positions, part.kept(), strict=True)):
                if part.has_value(at):
                    values[i] = tensor
        for delta in self._index.deltas:
            values.pop(delta.index, None)  # the encoded blob is no value of the state
        values.update(self._rebuilt)
        shapes = {
            i: (e.global_shape or e.shape, e.dtype) for i, e in enumerate(self._index.tensors)
        }
        shapes.update({d.index: (d.shape, d.dtype) for d in self._index.deltas})
        for i, entry in enumerate(self._index.tensors):
            if entry.global_shape is not None:
                values.pop(i, None)

        def value(i: int) -> torch.Tensor:
            found = values.get(i)
            if found is not None:
                return found
            shape, dtype = shapes[i]
            return torch.empty(
                shape, dtype=dtype_from_name(dtype, where=self._index_where), device="meta"
            )

        return self._decode(value)

    def _read_verified(self, name: str) -> torch.Tensor:
        """Tensor ``name`` of this rank, read into new memory and checked against its checksum."""
        for positions, part, _ in self._parts:
            for at, i in enumerate(positions):
                if self._index.tensors[i].name == name:
                    return part.read(at)
        raise CorruptCheckpointError(f"{self._index_where}: lists no tensor {name!r}")

    def finish(self, sharded: Mapping[str, torch.Tensor] | None = None) -> Any:
        """The state tree with its tensors; sharded ones from ``sharded`` (by name) when given,
        else this rank's pieces."""
        assert self._keep is True, "finish() of a RankRead that keeps not every tensor (verify)"
        tensors = self._tensors()
        names = [e.name for e in self._index.tensors]
        return self._decode(
            lambda i: tensors[i],
            None if sharded is None else (lambda i: sharded[names[i]]),
        )

    def _tensors(self) -> list[torch.Tensor]:
        base = self._base._tensors() if self._base is not None else []
        tensors: list[torch.Tensor] = [torch.empty(0)] * len(self._index.tensors)
        try:
            for positions, part, _ in self._parts:
                for i, tensor in zip(positions, part.fill(), strict=True):
                    tensors[i] = tensor
        except (OSError, EOFError) as exc:
            raise read_error(exc, self._where) from None
        if self._base is not None:
            by_name = {e.name: t for e, t in zip(self._base._index.tensors, base, strict=True)}
            for delta in self._index.deltas:
                rebuilt = self._rebuilt.get(delta.index)
                if rebuilt is not None:  # rebuilt and checked by verify(), no live destination
                    tensors[delta.index] = rebuilt
                    continue
                name = self._index.tensors[delta.index].name
                where = f"{self._where}: tensor {name!r}"
                target = by_name.get(name)
                if (
                    target is None
                    or tuple(target.shape) != delta.shape
                    or dtype_name(target.dtype, where=where) != delta.dtype
                ):
                    raise CorruptCheckpointError(
                        f"{where}: the base holds no {delta.dtype}{list(delta.shape)} tensor of that name"
                    )
                apply_delta(delta, tensors[delta.index], target, where)
                tensors[delta.index] = target
        return tensors

    def _decode(
        self,
        tensor_at: Callable[[int], torch.Tensor],
        sharded_at: Callable[[int], torch.Tensor] | None = None,
    ) -> Any:
        count = len(self._index.tensors)

        def checked(at: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
            def load(i: int) -> torch.Tensor:
                if i >= count:
                    raise CorruptCheckpointError(
                        f"{self._index_where}: the state refers to tensor #{i}, the index lists {count}"
                    )
                return at(i)

            return load

        return decode_tree(
            self._index.state,
            checked(tensor_at),
            self._index_where,
            load_sharded=None if sharded_at is None else checked(sharded_at),
        )

    def close(self) -> None:
        for _, _, stream in getattr(self, "_parts", []):
            stream.close()
        self._parts = []
        if getattr(self, "_base", None) is not None:
            assert self._base is not None
            self._base.close()


def _references(index: RankIndex, where: str) -> dict[int, str]:
    """Each tensor the state refers to, once (see
    :func:`~crashproof.checkpoint.format._state_tree.tensor_references`), and the place it is
    referred to from; every reference resolves to an entry of the index."""
    references = tensor_references(index.state, where)
    beyond = [i for i in references if i >= len(index.tensors)]
    if beyond:
        raise CorruptCheckpointError(
            f"{where}: the state refers to tensor #{beyond[0]}, the index lists {len(index.tensors)}"
        )
    return references


def _bound(
    into: Mapping[str, Any], index: RankIndex, references: Mapping[int, str]
) -> dict[str, Any]:
    """``into`` without the names whose tensor the state does not refer to from that very place.

    A live destination is named by where its value goes (``model/fc.weight``); an index whose
    state refers to that entry from elsewhere (an optimizer's ``exp_avg``, an extra) would have
    the checks judge a stand-in there while the load hands that place the live tensor. Such an
    entry is read into new memory and checked by value like any other."""
    at = {index.tensors[i].name: path for i, path in references.items()}
    return {name: tensor for name, tensor in into.items() if at.get(name) == name}


def _memory_span(tensor: Any) -> tuple[int, int] | None:
    """Where a contiguous CPU tensor's bytes lie, or None for one that is no destination."""
    if (
        isinstance(tensor, torch.Tensor)
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.numel()
    ):
        start = tensor.data_ptr()
        return start, start + tensor.numel() * tensor.element_size()
    return None


def _distinct_memory(into: Mapping[str, Any]) -> dict[str, Any]:
    """``into`` without the tensors whose memory overlaps one kept before them (tied weights, an
    EMA module sharing a parameter): every live byte has one destination, so a delta is applied
    to it once. Only contiguous CPU tensors can be destinations at all (see ``ShardRead``)."""
    spans: list[tuple[int, int, str]] = []
    for name, tensor in into.items():
        span = _memory_span(tensor)
        if span is not None:
            spans.append((*span, name))
    kept: set[str] = set()
    end = 0
    for start, stop, name in sorted(spans, key=lambda s: s[0]):  # stable: first listed first
        if start >= end:  # past every destination kept so far
            kept.add(name)
            end = stop
    return {name: into[name] for name in into if name in kept}


def _base_dir(storage: Storage, ckpt_dir: str, manifest: Manifest) -> str:
    assert manifest.base_step is not None
    parent = posixpath.dirname(ckpt_dir.rstrip("/"))
    return storage.join(parent, checkpoint_dir_name(manifest.base_step))


def unusable_base(
    storage: Storage, ckpt_dir: str, manifest: Manifest, exc: CorruptCheckpointError
) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{storage.describe(ckpt_dir)}: a delta against step {manifest.base_step}, whose "
        f"checkpoint cannot be used ({exc}); every delta on that base is unusable"
    )


def base_manifest(storage: Storage, ckpt_dir: str, manifest: Manifest) -> tuple[str, Manifest]:
    """The directory and manifest of the full checkpoint the delta ``manifest`` was taken
    against, checked to be that very checkpoint (its manifest's checksum, where the delta
    records it: a checkpoint saved again under the same step is another base)."""
    base_dir = _base_dir(storage, ckpt_dir, manifest)
    try:
        base_bytes, base = read_manifest_bytes(storage, base_dir)
        if (
            base.kind != "full"
            or base.step != manifest.base_step
            or base.world_size != manifest.world_size
        ):
            raise CorruptCheckpointError(
                f"it is a {base.kind} checkpoint of step {base.step} by {base.world_size} ranks"
            )
        found = digest(base_bytes)
        if manifest.base_manifest is not None and found != manifest.base_manifest:
            raise CorruptCheckpointError(
                f"its manifest has checksum {found}, the delta records {manifest.base_manifest}: "
                "it is not the checkpoint the delta was taken against (step "
                f"{manifest.base_step} was saved again since, e.g. after a restore fell back "
                "past it)"
            )
    except CorruptCheckpointError as exc:
        raise unusable_base(storage, ckpt_dir, manifest, exc) from None
    return base_dir, base


def load_rank_state(storage: Storage, ckpt_dir: str, manifest: Manifest, rank: int) -> Any:
    """Rank ``rank``'s state tree with its tensors, every byte verified against its checksum."""
    reader = RankRead(storage, ckpt_dir, manifest, rank)
    try:
        reader.verify()
        return reader.finish()
    finally:
        reader.close()


def verify_checkpoint(
    storage: Storage, ckpt_dir: str, *, on_bytes: Callable[[int], None] | None = None
) -> Manifest:
    """Check everything a restore checks, for every rank, without keeping the tensors; returns
    the manifest.

    The very checks a restore makes on its rank's part (:class:`RankRead`'s, then, where there
    are sharded tensors, :func:`~crashproof.checkpoint.format._pieces.sharded_pieces` across the ranks, as ``load_sharded``
    does), made for every rank: since the manifest lists each rank's index and shard and nothing
    else, that checks every file. ``on_bytes(n)`` is called as bytes are hashed (progress bars).
    """
    manifest = read_manifest(storage, ckpt_dir)
    indexes: list[RankIndex] = []
    where = storage.describe(ckpt_dir)
    # Saved on node-local roots: this directory holds one node's ranks' files, checked whole.
    held = held_part(manifest, storage.list(ckpt_dir), where)
    for rank in held:
        # Only the tensors judged by value are kept (the RNG states: a few KiB); the others
        # are hashed and stand in by shape and dtype, as a restore's live destinations do.
        reader = RankRead(
            storage, ckpt_dir, manifest, rank, keep=value_tensor_names, on_bytes=on_bytes
        )
        try:
            reader.verify()
            # The checks of the tree a restore makes before it compares with the live objects.
            check_structure(reader.check_tree(), where)
        finally:
            reader.close()
        indexes.append(reader.index)
    if (
        manifest.kind == "full"
        and manifest.nodes is None
        and any(e.global_shape is not None for index in indexes for e in index.tensors)
    ):
        sharded_pieces(indexes, storage.describe(ckpt_dir))
    return manifest
