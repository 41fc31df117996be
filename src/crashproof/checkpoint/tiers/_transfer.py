"""Copying whole checkpoints between storages: upload to a durable tier, download back.

A copy is committed the way a save is: the manifest goes last, so a reader of the destination sees
either the whole checkpoint or none. Both directions check what arrived: an upload is verified by
reading it back from the remote store (every checksum), a download before it is published into the
local root. Corruption at the source is caught the same way: a checkpoint that does not verify
where it landed is removed there and the copy fails.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from crashproof.checkpoint.format import MANIFEST_NAME, Manifest, parse_manifest
from crashproof.checkpoint.restore import held_files, read_manifest_bytes, verify_checkpoint
from crashproof.checkpoint.save import new_tmp_name
from crashproof.errors import CorruptCheckpointError
from crashproof.storage import ReadStream, Storage, local_backend, write_all

__all__ = ["PART_BYTES", "download_checkpoint", "remove_checkpoint", "upload_checkpoint"]

log = logging.getLogger("crashproof.checkpoint")

PART_BYTES = 8 * 1024 * 1024
"""Ranged reads of a streamed copy: enough per request to amortise its latency."""


def upload_checkpoint(
    local: Storage,
    local_dir: str,
    manifest_bytes: bytes,
    remote: Storage,
    remote_dir: str,
    *,
    parallel: int = 4,
    verify: bool = True,
) -> int:
    """Copy the committed checkpoint ``local_dir`` (whose manifest is ``manifest_bytes``) to
    ``remote_dir``, replacing what is there; returns the bytes copied.

    Files go up ``parallel`` at a time (each large one in parallel parts where the store can), the
    manifest last. With ``verify``, every checksum is then checked by reading the copy back; a
    copy that fails it is removed (manifest first) and :class:`CorruptCheckpointError` raised.
    """
    manifest = parse_manifest(manifest_bytes, local.describe(local.join(local_dir, MANIFEST_NAME)))
    names = _held(manifest, local, local_dir)
    remove_checkpoint(remote, remote_dir)  # what was there stops being a checkpoint first
    remote.make_dirs(remote_dir)
    with ThreadPoolExecutor(max(1, parallel), thread_name_prefix="crashproof-upload") as pool:
        futures = [
            pool.submit(
                _copy_file, local, local.join(local_dir, n), remote, remote.join(remote_dir, n)
            )
            for n in names
        ]
        for future in futures:
            future.result()
    write_all(remote, remote.join(remote_dir, MANIFEST_NAME), manifest_bytes)
    if verify:
        try:
            verify_checkpoint(remote, remote_dir)
        except (CorruptCheckpointError, OSError):
            remove_checkpoint(remote, remote_dir)
            raise
    return sum(manifest.files[n].size for n in names) + len(manifest_bytes)


def download_checkpoint(
    remote: Storage,
    remote_dir: str,
    local: Storage,
    local_root: str,
    final_name: str,
    *,
    parallel: int = 8,
) -> Manifest:
    """Copy the checkpoint ``remote_dir`` into ``local_root/final_name`` (replacing it) through a
    temporary directory, verify it there, then publish it; returns its manifest.

    Each file is read in ``PART_BYTES`` ranges, ``parallel`` at a time. A copy that does not
    verify is discarded and :class:`CorruptCheckpointError` raised; the local root is unchanged.
    """
    manifest_bytes, manifest = read_manifest_bytes(remote, remote_dir)
    tmp_dir = local.join(local_root, new_tmp_name(manifest.step))
    local.make_dirs(tmp_dir)
    try:
        with ThreadPoolExecutor(max(1, parallel), thread_name_prefix="crashproof-download") as pool:
            for name in _held(manifest, remote, remote_dir):
                _copy_file(
                    remote,
                    remote.join(remote_dir, name),
                    local,
                    local.join(tmp_dir, name),
                    (pool, parallel),
                )
        write_all(local, local.join(tmp_dir, MANIFEST_NAME), manifest_bytes)
        verify_checkpoint(local, tmp_dir)
        local.publish(tmp_dir, local.join(local_root, final_name), commit_marker=MANIFEST_NAME)
    except BaseException:
        local.remove(tmp_dir)
        raise
    return manifest


def _held(manifest: Manifest, storage: Storage, ckpt_dir: str) -> list[str]:
    """The files of ``ckpt_dir`` to copy, in order: on a node-local root, its node's part's."""
    return sorted(held_files(storage, ckpt_dir, manifest))


def remove_checkpoint(storage: Storage, ckpt_dir: str) -> None:
    """Delete a checkpoint so that it stops being one at once: the manifest first."""
    storage.remove(storage.join(ckpt_dir, MANIFEST_NAME))
    storage.remove(ckpt_dir)


def _copy_file(
    src: Storage,
    src_path: str,
    dst: Storage,
    dst_path: str,
    readers: tuple[ThreadPoolExecutor, int] | None = None,
) -> None:
    """One file from ``src`` to ``dst``. A local source goes through the destination's
    ``put_file`` (parallel multipart on object stores); any other is streamed in ranges, read
    ``readers`` (a pool and how many reads it may run at once) in parallel and written in order."""
    if local_backend(src) is not None:
        dst.put_file(src_path, dst_path)
        return
    stream = src.open(src_path)
    try:
        out = dst.create(dst_path)
        try:
            _stream_copy(stream, out.write, readers)
            out.commit()
        except BaseException:
            out.abort()
            raise
    finally:
        stream.close()


def _stream_copy(
    stream: ReadStream,
    write: Callable[[memoryview], None],
    readers: tuple[ThreadPoolExecutor, int] | None,
) -> None:
    size = stream.size()

    def read(offset: int) -> memoryview:
        buf = memoryview(bytearray(min(PART_BYTES, size - offset)))
        stream.readinto(offset, buf)
        return buf

    offsets = iter(range(0, size, PART_BYTES))
    if readers is None:
        for offset in offsets:
            write(read(offset))
        return
    # A window of reads in flight, written in order: memory stays at width x PART_BYTES.
    pool, width = readers
    window: deque[Future[memoryview]] = deque()
    for offset in offsets:
        window.append(pool.submit(read, offset))
        if len(window) >= width:
            write(window.popleft().result())
    while window:
        write(window.popleft().result())
