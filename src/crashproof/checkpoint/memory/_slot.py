"""One shared-memory segment of the agent's, mapped into this trainer: a staging area's buffers,
and the snapshot they hold once committed.

The segment is laid out as the rank's shard file would be on disk, the safetensors header ending
where the tensor bytes begin (on a page boundary). A staging area places its buffers there
(:meth:`Slot.reserve`), so the snapshot's one copy out of the live tensors lands in its final
place: committing it writes the header, the rank's index and its manifest, never the tensors again.

A segment a restarted trainer adopts is mapped read-only until the trainer first stages into it
(:meth:`Slot.reserve`, which tells the agent first): the agent may have checked the snapshot it
holds once no other process could write it (``verified``), and nothing in the new trainer can
change those bytes by mistake before its restore has read them.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import mmap
import os
from typing import Any

import torch

from crashproof._units import format_size
from crashproof.errors import CrashproofError, InsufficientMemoryError
from crashproof.link import MemoryClient

__all__ = ["PAGE", "Slot", "SlotContents", "malformed"]

log = logging.getLogger("crashproof.checkpoint")

PAGE = 4096

SlotContents = dict[str, Any]
"""What the agent keeps beside a committed segment: ``files`` (the index and the cut manifest,
base64), ``shard`` ([offset, size] of the shard file in the segment) and ``path`` (the
checkpoint directory's name)."""


class Slot:
    """Segment ``index`` of rank ``rank``'s snapshots for the root named by ``key``."""

    def __init__(
        self,
        client: MemoryClient | None,
        key: str,
        rank: int,
        world_size: int,
        index: int,
        *,
        buffers: int = 1,
    ) -> None:
        self._client = client  # (None: the agent's own look at a segment it holds)
        self.key, self.rank, self.world_size, self.index = key, rank, world_size, index
        self.buffers = buffers
        """How many staging buffers its manager has (a refusal names ``staging_buffers=1``
        only where there are more)."""
        self._mm: mmap.mmap | None = None
        self._fd: int | None = None  # kept while mapped read-only, to map it writable later
        self._registered: int | None = None  # the address given to cudaHostRegister
        self.step: int | None = None
        """The step of the committed snapshot it holds; None: none (or being overwritten)."""
        self.contents: SlotContents = {}
        self.origin = "local"
        """``local``, or ``peer:<node>``: the agent copied it from that node's agent."""
        self.verified = False
        """The agent checked every byte of the committed snapshot against its checksums after
        the last process that could write it had stopped, and no one has written it since (the
        segment is mapped read-only here until :meth:`reserve`): a restore need not hash it."""

    def _ids(self) -> dict[str, Any]:
        return {"key": self.key, "rank": self.rank, "slot": self.index,
                "world_size": self.world_size}  # fmt: skip

    @property
    def nbytes(self) -> int:
        return 0 if self._mm is None else len(self._mm)

    def adopt(
        self,
        fd: int,
        nbytes: int,
        step: int | None,
        contents: SlotContents,
        origin: str,
        *,
        verified: bool = False,
    ) -> None:
        """Map a segment the agent already held (this trainer restarted), read-only; ``fd`` is
        the slot's from now on."""
        try:
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.origin = origin
        why = malformed(contents, nbytes) if step is not None else None
        if why is not None:  # what the agent holds beside it is damaged: not offered
            log.warning(
                "rank %d's snapshot %d in the memory of crashproof run's agent is not offered: %s",
                self.rank,
                self.index,
                why,
            )
            step, contents = None, {}
        self.step, self.contents = step, contents
        self.verified = verified and step is not None

    def view(self) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)

    def reserve(self, nbytes: int, *, pin: bool) -> memoryview:
        """The segment, of at least ``nbytes``: the one held when it is large enough (and not
        more than twice too large), else a new one from the agent (the old one is dropped).
        ``pin``: page-locked for CUDA copies."""
        if self._mm is None or not nbytes <= len(self._mm) <= 2 * nbytes + PAGE:
            self.overwriting()
            self._unmap()
            size = -(-nbytes // PAGE) * PAGE
            reply, fds = self._host().request({"op": "allocate", **self._ids(), "nbytes": size})
            if not fds:
                raise _refusal(reply, self.rank, size, several=self.buffers > 1)
            self._map(fds[0], size)
            os.close(fds[0])
        elif self._fd is not None:  # adopted, mapped read-only: writable from here on
            self.overwriting()  # (the agent first: what it checked is no longer offered)
            fd, size, self._fd = self._fd, len(self._mm), None
            self._unmap()
            try:
                self._map(fd, size)
            finally:
                os.close(fd)
        if pin and self._registered is None:
            self._pin()
        return self.view()

    def overwriting(self) -> None:
        """Before a byte of the segment changes: from now on it holds no snapshot (answered by
        the agent before this returns, so a crash mid-copy leaves nothing half-written offered)."""
        if self.step is None and not self.contents:
            return
        self.step, self.contents, self.verified = None, {}, False
        reply, _ = self._host().request({"op": "invalidate", **self._ids()})
        if "error" in reply:
            raise CrashproofError(f"crashproof run's memory host: {reply['error']}")

    def commit(self, step: int, files: dict[str, bytes], shard: tuple[int, int], path: str) -> None:
        """The snapshot of ``step`` is complete in the segment: the agent now offers it."""
        contents: SlotContents = {
            "files": {n: base64.b64encode(b).decode("ascii") for n, b in files.items()},
            "shard": list(shard),
            "path": path,
        }
        reply, _ = self._host().request(
            {"op": "commit", **self._ids(), "step": step, "files": contents}
        )
        if "error" in reply:
            raise CrashproofError(f"crashproof run's memory host: {reply['error']}")
        self.step, self.contents, self.verified = step, contents, False

    def files(self) -> dict[str, bytes]:
        """The index and manifest committed beside the bytes (checked when adopted)."""
        return {n: base64.b64decode(b, validate=True) for n, b in self.contents["files"].items()}

    def close(self) -> None:
        self._unmap()

    def _host(self) -> MemoryClient:
        assert self._client is not None, "a segment looked at by its agent is not written"
        return self._client

    def _map(self, fd: int, nbytes: int) -> None:
        self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def _pin(self) -> None:
        """Page-lock the mapping so device-to-host copies into it are asynchronous DMA."""
        if not torch.cuda.is_available():
            return
        address = torch.frombuffer(self.view(), dtype=torch.uint8).data_ptr()
        code = torch.cuda.cudart().cudaHostRegister(address, self.nbytes, 0)  # type: ignore[no-untyped-call]
        if int(code) != 0:  # pageable: still correct, the copies are only synchronous
            log.warning("could not page-lock the memory snapshot segment (CUDA error %s)", code)
            return
        self._registered = address

    def _unmap(self) -> None:
        if self._registered is not None:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._registered)  # type: ignore[no-untyped-call]
            self._registered = None
        if self._mm is not None:
            # (A tensor over it still referenced: the mapping goes with the last one.)
            with contextlib.suppress(BufferError):
                self._mm.close()
        self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def malformed(contents: Any, nbytes: int) -> str | None:
    """Why what the agent holds beside a segment cannot be a committed snapshot's record, or
    None: files (name -> base64), the shard's [offset, size] inside the segment, a path."""
    try:
        files, shard, path = contents["files"], contents["shard"], contents["path"]
        if not isinstance(files, dict) or not isinstance(path, str) or len(shard) != 2:
            return "a record of the wrong shape"
        for name, data in files.items():
            if not isinstance(name, str):
                return "a file name that is not text"
            base64.b64decode(data, validate=True)
        start, size = shard
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, size)):
            return "a shard span that is not two whole numbers"
        if not 0 <= start <= start + size <= nbytes:
            return f"a shard span [{start}, +{size}) outside the {nbytes}-byte segment"
    except (KeyError, TypeError, ValueError) as exc:  # (binascii.Error is a ValueError)
        return f"a damaged record ({type(exc).__name__}: {exc})"
    return None


def _refusal(reply: dict[str, Any], rank: int, nbytes: int, *, several: bool) -> CrashproofError:
    """Why the agent refused a segment, and what to do (``several``: the manager has more than
    one staging buffer, and one fewer would need less)."""
    if reply.get("error") != "insufficient":
        return CrashproofError(f"crashproof run's memory host: {reply.get('error')}")
    available, limit = reply.get("available"), reply.get("limit")
    held = format_size(int(reply.get("held") or 0))
    if limit is not None:
        room = f"crashproof run --memory-limit {format_size(limit)} leaves " + (
            "an unknown amount" if available is None else format_size(available)
        )
        fix = "raise --memory-limit"
    else:
        room = (
            "the host has "
            + ("an unknown amount" if available is None else format_size(available))
            + " available beyond 256 MiB kept free"
        )
        fix = "free memory"
    return InsufficientMemoryError(
        f"memory snapshots of rank {rank} need {format_size(nbytes)} of shared memory held by "
        f"crashproof run's agent, but {room} (this node's snapshots hold {held})"
        + (f": {reply['why']}" if reply.get("why") else "")
        + f". To keep them, {fix}"
        + (", or use staging_buffers=1" if several else "")
        + "; or run with crashproof run --no-memory"
    )
