"""Host staging buffers for asynchronous saves: the snapshot is the only pause training sees.

Buffers are allocated once and reused by every later save of the same state (the hot path then
touches no fresh pages), so staging costs exactly one copy of the state in host memory. Before
allocating, the available host memory is checked, so a save that would push the machine into swap
or the OOM killer is refused with a message saying how much it needs.

CPU tensors are copied one by one: mid-sized ones by a plain memcpy (see :func:`_copy_cpu`), the
rest with ``copy_``. CUDA tensors go to pinned buffers on a side
stream: the copies are queued behind the work already issued, the training stream is told to wait
for them before it touches the parameters again (a GPU-side wait, the CPU goes on), and the writer
thread waits for the copies' event before it reads a byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from crashproof import _host_memory
from crashproof._host_memory import HEADROOM_BYTES
from crashproof.errors import InsufficientMemoryError

__all__ = ["StagingArea"]


class StagingArea:
    """Reusable host copies of a state's tensors, keyed by their names in the checkpoint."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: Any = None  # torch.cuda.Stream, created on the first CUDA tensor

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(
        self, tensors: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], Any]:
        """Copy ``tensors`` into the buffers; returns the staged list and a CUDA event (or None).

        The caller must make the writer wait for the event before it reads the staged bytes.
        """
        self._reserve(tensors)
        staged: list[tuple[str, torch.Tensor]] = []
        cuda_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in tensors:
            buffer = self._buffers[name]
            if tensor.is_cuda:
                cuda_pairs.append((buffer, tensor))
            else:
                _copy_cpu(buffer, tensor)
            staged.append((name, buffer))
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


def _copy_cpu(buffer: torch.Tensor, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if (
        tensor.numel() <= _PARALLEL_GRAIN
        or nbytes > _MEMCPY_MAX_BYTES
        or tensor.device.type != "cpu"
        or tensor.is_quantized
        or not tensor.is_contiguous()
    ):
        buffer.copy_(tensor)
        return
    # Byte views: numpy has no bfloat16 or float8, and a byte copy is exact for every dtype.
    source = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    np.copyto(buffer.view(-1).view(torch.uint8).numpy(), source)
