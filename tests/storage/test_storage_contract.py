"""The contract every storage backend must meet; each test runs on every backend.

A new backend (fsspec, S3, ...) joins by adding a case to the ``backend`` fixture: the checkpoint
format's guarantees rest on these behaviours and nothing else. Tests at the end of the file check
what only a POSIX filesystem can do (symbolic links).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from crashproof.storage import (
    LocalStorage,
    MemoryStorage,
    Storage,
    read_all,
    storage_for,
    write_all,
)


@pytest.fixture(params=["local", "memory", "fsspec-memory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Storage, str]]:
    """``(storage, root)``: an empty, existing directory on a fresh backend. ``s3`` is a real
    S3-protocol server on loopback (moto's), reached through ``AWS_ENDPOINT_URL``."""
    storage: Storage
    if request.param == "local":
        storage, root = LocalStorage(), str(tmp_path / "root")
    elif request.param == "memory":
        storage, root = MemoryStorage(), "/mem/root"
    elif request.param == "fsspec-memory":
        root, storage = storage_for(f"memory://contract-{uuid.uuid4().hex}/root")
    else:
        request.getfixturevalue("s3_server")
        root, storage = storage_for(f"s3://contract-{uuid.uuid4().hex}/root")
    storage.make_dirs(root)
    yield storage, root


def _read(storage: Storage, path: str, offset: int = 0, size: int | None = None) -> bytes:
    stream = storage.open(path)
    try:
        if size is None:
            size = stream.size() - offset
        buf = bytearray(size)
        stream.readinto(offset, memoryview(buf))
        return bytes(buf)
    finally:
        stream.close()


def test_storage_classes_implement_the_protocol(backend: tuple[Storage, str]) -> None:
    storage, _ = backend
    assert isinstance(storage, Storage)


# -- writing and reading ---------------------------------------------------------------------


def test_appended_writes_read_back_whole_and_at_any_offset(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "data.bin")
    chunks = [bytes(range(256)) * 3, b"", b"middle", memoryview(bytes(range(100, 200))), b"end"]
    expected = b"".join(bytes(c) for c in chunks)

    stream = storage.create(path)
    for chunk in chunks:
        stream.write(chunk)
    stream.commit()

    reader = storage.open(path)
    try:
        assert reader.size() == len(expected)
        whole = bytearray(len(expected))
        reader.readinto(0, memoryview(whole))
        assert bytes(whole) == expected
        part = bytearray(50)
        reader.readinto(700, memoryview(part))
        assert bytes(part) == expected[700:750]
        tail = bytearray(3)
        reader.readinto(len(expected) - 3, memoryview(tail))
        assert bytes(tail) == b"end"
        reader.readinto(len(expected), memoryview(bytearray(0)))  # an empty read at the end
        # A 0-element tensor's bytes are a read-only empty view: reading into it is a no-op.
        reader.readinto(0, memoryview(b""))
        reader.readinto(len(expected), memoryview(b""))
    finally:
        reader.close()


def test_write_accepts_memoryviews_of_any_format(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "ints.bin")
    values = memoryview(bytearray(range(16))).cast("I")  # 4-byte items
    stream = storage.create(path)
    stream.write(values)
    stream.commit()
    assert _read(storage, path) == bytes(range(16))


def test_reading_past_the_end_raises_eoferror(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "short.bin")
    write_all(storage, path, b"0123456789")
    stream = storage.open(path)
    try:
        with pytest.raises(EOFError):
            stream.readinto(5, memoryview(bytearray(6)))
        with pytest.raises(EOFError):
            stream.readinto(10, memoryview(bytearray(1)))
        with pytest.raises(EOFError):
            stream.readinto(100, memoryview(bytearray(1)))
    finally:
        stream.close()


def test_create_refuses_an_existing_file_and_leaves_it_intact(
    backend: tuple[Storage, str],
) -> None:
    storage, root = backend
    path = storage.join(root, "taken.bin")
    write_all(storage, path, b"original")
    with pytest.raises(FileExistsError):
        storage.create(path)
    assert _read(storage, path) == b"original"


def test_create_refuses_a_file_still_being_written(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "busy.bin")
    first = storage.create(path)
    first.write(b"first")
    with pytest.raises(FileExistsError):
        storage.create(path)
    first.commit()
    assert _read(storage, path) == b"first"


def test_abort_removes_the_partial_file(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "partial.bin")
    stream = storage.create(path)
    stream.write(b"half of it")
    stream.abort()
    assert storage.list(root) == []
    with pytest.raises(FileNotFoundError):
        storage.open(path)
    # The name is free again.
    write_all(storage, path, b"again")
    assert _read(storage, path) == b"again"


def test_write_all_and_read_all_round_trip(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "small.json")
    write_all(storage, path, b'{"step": 5}')
    assert read_all(storage, path, limit=11) == b'{"step": 5}'
    write_all(storage, storage.join(root, "empty"), b"")
    assert read_all(storage, storage.join(root, "empty"), limit=0) == b""


def test_read_all_refuses_a_file_larger_than_its_limit(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "big.bin")
    write_all(storage, path, b"x" * 100)
    with pytest.raises(ValueError, match="100 bytes"):
        read_all(storage, path, limit=99)


@pytest.mark.parametrize("name", ["missing.bin", "nested/missing.bin"])
def test_opening_a_missing_file_raises_filenotfounderror(
    backend: tuple[Storage, str], name: str
) -> None:
    storage, root = backend
    with pytest.raises(FileNotFoundError):
        storage.open(storage.join(root, *name.split("/")))
    with pytest.raises(FileNotFoundError):
        read_all(storage, storage.join(root, *name.split("/")), limit=10)


def test_opening_a_directory_raises_filenotfounderror(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    directory = storage.join(root, "dir")
    storage.make_dirs(directory)
    write_all(storage, storage.join(directory, "file"), b"x")
    with pytest.raises(FileNotFoundError):
        storage.open(directory)


# -- directories -----------------------------------------------------------------------------


def test_list_returns_the_sorted_names_of_direct_children(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    for name in ["b.bin", "a.bin", "C.bin"]:
        write_all(storage, storage.join(root, name), b"x")
    storage.make_dirs(storage.join(root, "sub", "deeper"))
    write_all(storage, storage.join(root, "sub", "deeper", "f"), b"x")
    write_all(storage, storage.join(root, "sub", "g"), b"x")

    assert storage.list(root) == ["C.bin", "a.bin", "b.bin", "sub"]
    assert storage.list(storage.join(root, "sub")) == ["deeper", "g"]
    assert storage.list(storage.join(root, "sub", "deeper")) == ["f"]


def test_list_of_a_missing_directory_is_empty(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    assert storage.list(storage.join(root, "nowhere")) == []
    assert storage.list(storage.join(root, "nowhere", "deeper")) == []


def test_list_sees_neither_siblings_sharing_a_name_prefix_nor_files_as_directories(
    backend: tuple[Storage, str],
) -> None:
    storage, root = backend
    storage.make_dirs(storage.join(root, "step_1"))
    storage.make_dirs(storage.join(root, "step_10"))
    write_all(storage, storage.join(root, "step_10", "x"), b"x")
    write_all(storage, storage.join(root, "step_1.bin"), b"x")

    assert storage.list(storage.join(root, "step_1")) == []
    assert storage.list(storage.join(root, "step_1.bin")) == []


def test_make_dirs_creates_parents_and_is_idempotent(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    deep = storage.join(root, "a", "b", "c")
    storage.make_dirs(deep)
    storage.make_dirs(deep)
    assert storage.list(root) == ["a"]
    assert storage.list(storage.join(root, "a")) == ["b"]
    assert storage.list(storage.join(root, "a", "b")) == ["c"]
    assert storage.list(deep) == []

    write_all(storage, storage.join(deep, "kept"), b"x")
    storage.make_dirs(deep)
    assert storage.list(deep) == ["kept"]
    assert _read(storage, storage.join(deep, "kept")) == b"x"


def test_put_file_copies_a_local_file_and_replaces_what_was_there(
    backend: tuple[Storage, str], tmp_path: Path
) -> None:
    storage, root = backend
    big = os.urandom(3 * 1024 * 1024 + 17)
    local = tmp_path / "upload.bin"
    local.write_bytes(big)
    target = storage.join(root, "uploaded.bin")
    write_all(storage, target, b"older content")

    storage.put_file(str(local), target)

    assert storage.list(root) == ["uploaded.bin"]
    assert _read(storage, target) == big
    assert _read(storage, target, offset=1024 * 1024 + 5, size=9) == big[1024 * 1024 + 5 :][:9]


def test_put_file_of_a_missing_local_file_raises_and_writes_nothing(
    backend: tuple[Storage, str], tmp_path: Path
) -> None:
    storage, root = backend
    with pytest.raises(FileNotFoundError):
        storage.put_file(str(tmp_path / "absent"), storage.join(root, "x"))
    assert storage.list(root) == []


def _write_dir(storage: Storage, directory: str, files: dict[str, bytes]) -> None:
    storage.make_dirs(directory)
    for name, data in files.items():
        write_all(storage, storage.join(directory, name), data)


def test_publish_moves_every_file_to_the_final_name(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    tmp, final = storage.join(root, ".tmp-step_5"), storage.join(root, "step_5")
    files = {"manifest.json": b"{}", "shard-0.bin": bytes(range(256)), "index-0.json": b"[]"}
    _write_dir(storage, tmp, files)

    storage.publish(tmp, final)

    assert storage.list(root) == ["step_5"]
    assert storage.list(tmp) == []
    assert storage.list(final) == sorted(files)
    for name, data in files.items():
        assert _read(storage, storage.join(final, name)) == data
    with pytest.raises(FileNotFoundError):
        storage.open(storage.join(tmp, "manifest.json"))


def test_publish_moves_nested_files_too(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    tmp, final = storage.join(root, "tmp"), storage.join(root, "final")
    _write_dir(storage, storage.join(tmp, "sub"), {"inner": b"inner"})
    write_all(storage, storage.join(tmp, "outer"), b"outer")

    storage.publish(tmp, final)

    assert storage.list(final) == ["outer", "sub"]
    assert _read(storage, storage.join(final, "sub", "inner")) == b"inner"
    assert storage.list(root) == ["final"]


def test_publish_keeps_empty_subdirectories(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    tmp, final = storage.join(root, "tmp"), storage.join(root, "final")
    storage.make_dirs(storage.join(tmp, "empty"))
    write_all(storage, storage.join(tmp, "f"), b"x")

    storage.publish(tmp, final)

    assert storage.list(final) == ["empty", "f"]


def test_publish_replaces_an_existing_directory_entirely(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    final = storage.join(root, "step_5")
    _write_dir(storage, final, {"old-only.bin": b"old", "shared.bin": b"old shared"})
    _write_dir(storage, storage.join(final, "old-sub"), {"deep": b"old deep"})
    tmp = storage.join(root, ".tmp-step_5-abc")
    _write_dir(storage, tmp, {"shared.bin": b"new shared", "new-only.bin": b"new"})

    storage.publish(tmp, final)

    assert storage.list(final) == ["new-only.bin", "shared.bin"]
    assert _read(storage, storage.join(final, "shared.bin")) == b"new shared"
    assert _read(storage, storage.join(final, "new-only.bin")) == b"new"
    for gone in ["old-only.bin", "old-sub/deep"]:
        with pytest.raises(FileNotFoundError):
            storage.open(storage.join(final, *gone.split("/")))
    assert storage.list(root) == ["step_5"], "nothing of the old directory may be left around"


def test_publish_leaves_sibling_directories_alone(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    _write_dir(storage, storage.join(root, "step_1"), {"a": b"1"})
    _write_dir(storage, storage.join(root, "step_10"), {"a": b"10"})
    _write_dir(storage, storage.join(root, "tmp"), {"a": b"new 1"})

    storage.publish(storage.join(root, "tmp"), storage.join(root, "step_1"))

    assert storage.list(root) == ["step_1", "step_10"]
    assert _read(storage, storage.join(root, "step_1", "a")) == b"new 1"
    assert _read(storage, storage.join(root, "step_10", "a")) == b"10"


def test_remove_deletes_a_file(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    write_all(storage, storage.join(root, "doomed"), b"x")
    write_all(storage, storage.join(root, "doomed-not"), b"y")
    storage.remove(storage.join(root, "doomed"))
    assert storage.list(root) == ["doomed-not"]
    with pytest.raises(FileNotFoundError):
        storage.open(storage.join(root, "doomed"))


def test_remove_deletes_a_whole_tree_and_nothing_beside_it(
    backend: tuple[Storage, str],
) -> None:
    storage, root = backend
    tree = storage.join(root, "step_1")
    _write_dir(storage, storage.join(tree, "a", "b"), {"deep": b"x"})
    _write_dir(storage, tree, {"top": b"x"})
    storage.make_dirs(storage.join(tree, "empty"))
    _write_dir(storage, storage.join(root, "step_10"), {"kept": b"kept"})

    storage.remove(tree)

    assert storage.list(root) == ["step_10"]
    assert storage.list(tree) == []
    with pytest.raises(FileNotFoundError):
        storage.open(storage.join(tree, "a", "b", "deep"))
    assert _read(storage, storage.join(root, "step_10", "kept")) == b"kept"
    # The name can be used again.
    _write_dir(storage, tree, {"new": b"new"})
    assert storage.list(tree) == ["new"]


def test_remove_ignores_missing_paths(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    storage.remove(storage.join(root, "never-was"))
    storage.remove(storage.join(root, "never", "was"))
    write_all(storage, storage.join(root, "f"), b"x")
    storage.remove(storage.join(root, "f"))
    storage.remove(storage.join(root, "f"))
    assert storage.list(root) == []


def test_describe_names_the_path(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    assert "step_5" in storage.describe(storage.join(root, "step_5"))


# -- LocalStorage only -----------------------------------------------------------------------


def test_local_open_refuses_to_follow_a_symlink(tmp_path: Path) -> None:
    storage = LocalStorage()
    target = tmp_path / "target.bin"
    target.write_bytes(b"secret")
    link = tmp_path / "link.bin"
    os.symlink(target, link)
    with pytest.raises(FileNotFoundError, match="symbolic link"):
        storage.open(str(link))
    assert _read(storage, str(target)) == b"secret"


def test_local_open_of_a_directory_or_a_link_to_one_raises_filenotfounderror(
    tmp_path: Path,
) -> None:
    storage = LocalStorage()
    directory = tmp_path / "dir"
    directory.mkdir()
    os.symlink(directory, tmp_path / "dir-link")
    with pytest.raises(FileNotFoundError):
        storage.open(str(directory))
    with pytest.raises(FileNotFoundError):
        storage.open(str(tmp_path / "dir-link"))


def test_local_create_does_not_write_through_a_symlink(tmp_path: Path) -> None:
    storage = LocalStorage()
    target = tmp_path / "elsewhere.bin"
    os.symlink(target, tmp_path / "dangling.bin")
    with pytest.raises(FileExistsError):
        storage.create(str(tmp_path / "dangling.bin"))
    assert not target.exists()


def test_local_remove_of_a_symlink_spares_its_target(tmp_path: Path) -> None:
    storage = LocalStorage()
    directory = tmp_path / "real"
    directory.mkdir()
    (directory / "keep").write_bytes(b"x")
    os.symlink(directory, tmp_path / "link")
    storage.remove(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link")
    assert (directory / "keep").read_bytes() == b"x"


def test_local_publish_leaves_no_trash_of_the_replaced_directory(tmp_path: Path) -> None:
    storage = LocalStorage()
    final, tmp = tmp_path / "step_1", tmp_path / "tmp"
    for directory, data in ((final, b"old"), (tmp, b"new")):
        directory.mkdir()
        (directory / "f").write_bytes(data)
    storage.publish(str(tmp), str(final))
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    assert (final / "f").read_bytes() == b"new"


def test_publish_replacing_a_directory_leaves_no_trace_of_the_temporary_name(
    backend: tuple[Storage, str],
) -> None:
    storage, root = backend
    final, tmp = storage.join(root, "step_1"), storage.join(root, ".tmp-step_1-x")
    storage.make_dirs(final)
    storage.make_dirs(tmp)
    write_all(storage, storage.join(final, "a"), b"old")
    write_all(storage, storage.join(tmp, "a"), b"new")
    storage.publish(tmp, final, commit_marker="a")
    assert storage.list(root) == ["step_1"]
    assert _read(storage, storage.join(final, "a")) == b"new"


def test_local_list_leaves_symlinks_out(tmp_path: Path) -> None:
    storage = LocalStorage()
    (tmp_path / "real").mkdir()
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link-dir")
    os.symlink(tmp_path / "file", tmp_path / "link-file")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    assert storage.list(str(tmp_path)) == ["file", "real"]


def test_local_open_refuses_a_file_in_a_symlinked_directory(tmp_path: Path) -> None:
    storage = LocalStorage()
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(FileNotFoundError, match="symbolic link"):
        storage.open(str(tmp_path / "link" / "f"))


def test_local_open_of_a_fifo_neither_blocks_nor_reads(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")  # no writer: a blocking open would wait forever
    with pytest.raises(FileNotFoundError, match="regular file"):
        LocalStorage().open(str(tmp_path / "pipe"))


def test_local_put_file_refuses_a_fifo_or_a_link_as_its_source(tmp_path: Path) -> None:
    storage = LocalStorage()
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "real").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    for source in ("pipe", "link"):
        with pytest.raises(FileNotFoundError):
            storage.put_file(str(tmp_path / source), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_local_publish_swaps_or_sets_the_old_copy_aside_and_rolls_back_a_failed_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crashproof.storage import _local

    storage = LocalStorage()
    final, tmp = tmp_path / "step_1", tmp_path / "tmp"
    final.mkdir()
    (final / "a").write_bytes(b"old")
    tmp.mkdir()
    (tmp / "a").write_bytes(b"new")
    monkeypatch.setattr(_local, "_exchange", lambda a, b: False)  # no renameat2 here
    real_rename = os.rename

    def failing(src: str, dst: str) -> None:
        if src == str(tmp):
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError):
        storage.publish(str(tmp), str(final))
    assert (final / "a").read_bytes() == b"old", "a failed publish must put the old copy back"
    assert sorted(os.listdir(tmp_path)) == ["step_1", "tmp"]
