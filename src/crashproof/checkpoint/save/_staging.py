"""Host staging buffers for asynchronous saves: the snapshot is the only pause training sees.

Buffers are allocated once and reused by every later save of the same state (the hot path then
touches no fresh pages), so staging costs exactly one copy of the state in host memory. Before
allocating, the available host memory is checked, so a save that would push the machine into swap
or the OOM killer is refused with a message saying how much it needs.

CPU tensors are copied one by one: mid-sized ones by a plain memcpy, on two threads when they are
many (see :func:`_copy_all_cpu`), the rest with ``copy_``. CUDA tensors go to pinned buffers on a side
stream: the copies are queued behind the work already issued, the training stream is told to wait
for them before it touches the parameters again (a GPU-side wait, the CPU goes on), and the writer
thread waits for the copies' event before it reads a byte.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from crashproof import _host_memory
from crashproof._host_memory import HEADROOM_BYTES
from crashproof.checkpoint.format import copy_tensor_bytes, shard_layout
from crashproof.errors import CrashproofError, InsufficientMemoryError

__all__ = ["Arena", "ArenaUnavailable", "StagingArea"]

_PAGE = 4096


class Arena(Protocol):
    """One block of memory a staging area lays its buffers out in, as the shard file would hold
    them (a memory snapshot's segment, :mod:`crashproof.checkpoint.memory`), instead of each
    buffer in private memory of its own."""

    def reserve(self, nbytes: int, *, pin: bool) -> memoryview:
        """A writable block of at least ``nbytes`` (checked against the node's memory)."""
        ...

    def overwriting(self) -> None:
        """Called before the buffers are copied into: what the block held is gone."""
        ...


class ArenaUnavailable(Exception):
    """The arena refused the buffers (no memory for them, or its owner is gone): ``cause``
    says why. The caller may stage into buffers of its own instead."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class StagingArea:
    """Reusable host copies of a state's tensors, keyed by their names in the checkpoint.

    With an ``arena``, the buffers are views into it, at the places the shard file gives the
    tensors: ``data_at`` is where the first one begins (the header ends there)."""

    def __init__(self, arena: Arena | None = None) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: Any = None  # torch.cuda.Stream, created on the first CUDA tensor
        self.arena = arena
        self._layout: list[tuple[str, torch.dtype, torch.Size]] = []
        self.data_at = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(
        self, tensors: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], Any]:
        """Copy ``tensors`` into the buffers; returns the staged list and a CUDA event (or None).

        The caller must make the writer wait for the event before it reads the staged bytes.
        """
        if self.arena is not None:
            self._reserve_in_arena(tensors, self.arena)
            try:
                self.arena.overwriting()
            except (CrashproofError, OSError) as exc:
                raise ArenaUnavailable(exc) from exc
        else:
            self._reserve(tensors)
        staged: list[tuple[str, torch.Tensor]] = []
        cuda_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        cpu_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in tensors:
            buffer = self._buffers[name]
            (cuda_pairs if tensor.is_cuda else cpu_pairs).append((buffer, tensor))
            staged.append((name, buffer))
        _copy_all_cpu(cpu_pairs)
        return staged, self._copy_from_cuda(cuda_pairs) if cuda_pairs else None

    def _reserve(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Make a buffer of the right shape and dtype for every tensor; drop buffers no longer used."""
        wanted = {name for name, _ in tensors}
        for name in [n for n in self._buffers if n not in wanted]:
            del self._buffers[name]
        missing = [
            (name, t) for name, t in tensors
            if (b := self._buffers.get(name)) is None or b.shape != t.shape or b.dtype != t.dtype
        ]  # fmt: skip
        need = sum(t.numel() * t.element_size() for _, t in missing)
        available = (
            _host_memory.available_memory_bytes() if need else None
        )  # a save that reuses reads nothing
        if available is not None and need + HEADROOM_BYTES > available:
            raise InsufficientMemoryError(
                f"an asynchronous save needs {need / 2**20:.0f} MiB of host memory for its staging "
                f"buffers (plus {HEADROOM_BYTES / 2**20:.0f} MiB headroom), but only "
                f"{available / 2**20:.0f} MiB is available. Free memory, or save synchronously "
                "(CheckpointManager(async_save=False)), which needs no staging copy."
            )
        for name, tensor in missing:
            pin = tensor.is_cuda and torch.cuda.is_available()
            self._buffers[name] = torch.empty(
                tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin
            )

    def _reserve_in_arena(self, tensors: Sequence[tuple[str, torch.Tensor]], arena: Arena) -> None:
        """Lay the buffers out in ``arena`` as the shard file would hold the tensors, in their
        order, unless they are laid out so already."""
        layout = [(name, t.dtype, t.shape) for name, t in tensors]
        if layout == self._layout:
            return
        self._buffers, self._layout = {}, []  # (the old block's views go before it does)
        header, ranges = shard_layout(tensors)
        data_at = -(-len(header) // _PAGE) * _PAGE
        total = data_at + sum(nbytes for _, nbytes in ranges)
        try:
            block = arena.reserve(total, pin=any(t.is_cuda for _, t in tensors))
        except (CrashproofError, OSError) as exc:
            raise ArenaUnavailable(exc) from exc
        for (name, tensor), (pos, nbytes) in zip(tensors, ranges, strict=True):
            if nbytes == 0:
                self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype)
                continue
            flat = torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=data_at + pos)
            self._buffers[name] = flat.view(tensor.dtype).view(tensor.shape)
        self._layout, self.data_at = layout, data_at

    def release(self) -> None:
        """Drop the buffers (an arena's views with them)."""
        self._buffers, self._layout = {}, []

    def _copy_from_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        training_stream = torch.cuda.current_stream()
        self._stream.wait_stream(training_stream)  # copy the values as of this point of the step
        with torch.cuda.stream(self._stream):
            for buffer, tensor in pairs:
                buffer.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)  # keep the allocator from reusing it early
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        # The training loop may modify the parameters right after save() returns: its later kernels
        # must not run before the copies have read them.
        training_stream.wait_stream(self._stream)
        return done


# torch splits a copy of more elements than its grain size (32768) over its intra-op threads and
# waits for all of them. On a busy host (DataLoader workers, the writer thread, other jobs) one of
# those threads is often descheduled, and the training loop then waits tens of milliseconds for a
# copy of a few hundred kilobytes (benchmarks/save_pause.py, beside one busy process: p90 32 ms
# for the demo model's 1.1 MB by copy_, 0.56 ms by one memcpy). Up to _MEMCPY_MAX_BYTES a
# single-threaded memcpy is fast anyway; above it the threads' bandwidth is worth their wait.
_PARALLEL_GRAIN = 32768
_MEMCPY_MAX_BYTES = 16 * 1024 * 1024


# Mid-sized tensors (between the grain and _MEMCPY_MAX_BYTES) are each one memcpy on one
# thread; a state made mostly of them (a transformer's weight matrices of a few MB each) would
# then be staged at one core's bandwidth. Past _SPLIT_MIN_BYTES of them, a second thread (ours,
# started once; NumPy's copy lets the GIL go) copies half of them at the same time: twice the
# bandwidth on two cores, and no wait on a team of intra-op threads per tensor.
_SPLIT_MIN_BYTES = 64 * 1024 * 1024
_helper: tuple[int, ThreadPoolExecutor] | None = None
"""The helper thread's executor, with the pid of the process it runs in."""


def _helper_thread() -> ThreadPoolExecutor:
    """This process's helper (a forked child has none of its parent's threads: it starts its own)."""
    global _helper
    if _helper is None or _helper[0] != os.getpid():
        _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="crashproof-stage"))
    return _helper[1]


def _copy_all_cpu(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(buffer, tensor)``, the mid-sized ones on two threads when they are many."""
    single: list[tuple[torch.Tensor, torch.Tensor]] = []
    for buffer, tensor in pairs:
        if _single_memcpy(tensor):
            single.append((buffer, tensor))
        else:
            buffer.copy_(tensor)
    if sum(_nbytes(t) for _, t in single) < _SPLIT_MIN_BYTES:
        _memcpy_each(single)
        return
    halves: tuple[list[tuple[torch.Tensor, torch.Tensor]], ...] = ([], [])
    loads = [0, 0]
    for buffer, tensor in sorted(single, key=lambda pair: -_nbytes(pair[1])):
        lighter = loads.index(min(loads))  # largest first, onto the lighter half: balanced
        halves[lighter].append((buffer, tensor))
        loads[lighter] += _nbytes(tensor)
    other = _helper_thread().submit(_memcpy_each, halves[1])
    _memcpy_each(halves[0])
    other.result()


def _memcpy_each(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buffer, tensor in pairs:
        copy_tensor_bytes(buffer, tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _single_memcpy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is copied by one memcpy on one thread (else by ``copy_``)."""
    return (
        tensor.numel() > _PARALLEL_GRAIN
        and _nbytes(tensor) <= _MEMCPY_MAX_BYTES
        and tensor.device.type == "cpu"
        and not tensor.is_quantized
        and tensor.is_contiguous()
    )
