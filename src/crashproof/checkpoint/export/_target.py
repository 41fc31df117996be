"""Where an export may write, and what it may replace.

An export never deletes what it did not write. :func:`check_target` refuses the current
directory, the checkpoint root, their ancestors, anything inside the root, a path under a file and
a link; an existing target is replaced only when it is empty, or when it carries the mark of an
earlier export (the :data:`MARKER` file in a DCP directory, :data:`MARK_KEY` in a safetensors
header or index) and ``force`` is given. The files of an earlier export that a new one does not
overwrite are removed only if they carry that mark (:func:`remove_earlier`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Sequence
from typing import Any, BinaryIO, Literal

from crashproof._files import check_parent
from crashproof.errors import ConfigError
from crashproof.storage import Storage

__all__ = [
    "MARKER",
    "MARK_KEY",
    "Kind",
    "check_target",
    "file_mark",
    "files_under",
    "listed_shards",
    "protected_roots",
    "remove_earlier",
]

MARKER = ".crashproof-export.json"
"""In a directory an export wrote (DCP, hf): which export wrote it and the files it wrote
(``--force`` replaces such a directory only while it holds nothing else)."""
_OWN_OUTPUT = {
    # the names torch.distributed.checkpoint's file system writer gives what it writes
    "dcp": re.compile(r"\.metadata|__\d+_\d+\.distcp"),
    # a save_pretrained directory's weights, their index and the configs
    "hf": re.compile(
        r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
        r"|config\.json|generation_config\.json"
    ),
}
"""By the marker's ``format``: the only names a forced export replaces, whatever the marker
lists (see :func:`_check_dir_target`)."""

MARK_KEY = "crashproof_export"
"""In a safetensors export's ``__metadata__`` and its index's ``metadata``: which export wrote it."""

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on its JSON header

Kind = Literal["file", "dir"]


def check_target(
    out: str, *, kind: Kind, force: bool = False, protected: Sequence[str] = ()
) -> None:
    """Refuse (:class:`ConfigError`, naming ``out``) an output path an export must not write.

    Never the current directory, a directory it lies in, or any of ``protected`` (the checkpoint
    root), a directory one of them lies in, or a path inside one of them; never under a file;
    never a link. An existing target must be empty, or an earlier export of the same kind
    (:data:`MARKER` / :data:`MARK_KEY`) replaced with ``force``.
    """
    if not out:
        raise ConfigError("-o '': give the path to write the export to")
    real = os.path.realpath(out)
    for place, what in [(os.getcwd(), "the current directory")] + [
        (p, f"the checkpoint root {p}") for p in protected
    ]:
        there = os.path.realpath(place)
        if real == there:
            raise ConfigError(f"-o {out}: that is {what}; export into a new path")
        if _inside(there, real):
            raise ConfigError(f"-o {out}: that directory holds {what}; export into a new path")
        if what != "the current directory" and _inside(real, there):
            raise ConfigError(
                f"-o {out}: that is inside {what}, where only checkpoints belong; "
                "export to a path outside it"
            )
    check_parent(out)
    if not os.path.lexists(out):
        return
    if os.path.islink(out):
        raise ConfigError(
            f"-o {out}: is a symbolic link; an export replaces only what it wrote itself: "
            "remove the link or choose another path"
        )
    if kind == "dir":
        _check_dir_target(out, force)
    else:
        _check_file_target(out, force)


def _inside(path: str, directory: str) -> bool:
    """``path`` lies strictly inside ``directory`` (both resolved)."""
    return path != directory and path.startswith(directory.rstrip(os.sep) + os.sep)


def _check_dir_target(out: str, force: bool) -> None:
    if not os.path.isdir(out):
        raise ConfigError(
            f"-o {out}: exists and is not a directory; this export writes a directory: "
            "choose a new path"
        )
    present = files_under(out)
    if not present:
        return
    mark = _dcp_mark(out)
    if mark is None:
        raise ConfigError(
            f"-o {out}: the directory is not empty and was not written by crashproof export "
            f"(no {MARKER}); an export never replaces what it did not write: choose a new or "
            "empty directory"
        )
    # Only what a DCP export writes counts as its own, whatever the marker lists: the marker is
    # a plain file anyone can write, and one listing a user's file must not get it replaced.
    listed = {name for name in mark.get("files", []) if isinstance(name, str)}
    own = _OWN_OUTPUT.get(str(mark.get("format", "dcp")), _OWN_OUTPUT["dcp"])
    extra = sorted(
        name for name in present
        if name != MARKER and (name not in listed or not own.fullmatch(name))
    )  # fmt: skip
    if extra:
        raise ConfigError(
            f"-o {out}: holds an earlier export, but also {os.path.join(out, extra[0])}, which "
            "the export did not write; move it away or choose another directory"
        )
    if not force:
        raise ConfigError(
            f"-o {out}: holds an earlier export (step {mark.get('step')}); "
            "give --force to replace it"
        )


def _check_file_target(out: str, force: bool) -> None:
    if os.path.isdir(out):
        raise ConfigError(
            f"-o {out}: is a directory; a safetensors export writes a file: "
            f"give a file path such as {os.path.join(out, 'model.safetensors')}"
        )
    if not os.path.isfile(out):
        raise ConfigError(f"-o {out}: exists and is not a regular file; choose another path")
    if os.path.getsize(out) == 0:
        return
    mark = file_mark(out)
    if mark is None:
        raise ConfigError(
            f"-o {out}: the file exists and was not written by crashproof export; an export "
            "never replaces what it did not write: choose a new path"
        )
    if not force:
        raise ConfigError(f"-o {out}: holds an earlier export ({mark}); give --force to replace it")


def files_under(directory: str) -> list[str]:
    """Every entry under ``directory`` (relative paths; directories too, links not followed)."""
    found = []
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            found.append(os.path.relpath(os.path.join(parent, name), directory))
    return found


def _dcp_mark(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, MARKER)
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with _open_regular(path) as f:
            mark = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) and mark.get("command") == "export" else None


def file_mark(path: str) -> str | None:
    """The :data:`MARK_KEY` of a safetensors file or index written by an export, else None."""
    try:
        with _open_regular(path) as f:
            if f.read(1) == b"{":  # an index (JSON); a safetensors file starts with its length
                f.seek(0)
                doc = json.loads(f.read(_MAX_HEADER))
                meta = doc.get("metadata") if isinstance(doc, dict) else None
            else:
                f.seek(0)
                length = int.from_bytes(f.read(8), "little")
                if not 0 < length <= _MAX_HEADER:
                    return None
                header = json.loads(f.read(length))
                meta = header.get("__metadata__") if isinstance(header, dict) else None
    except (OSError, ValueError):
        return None
    mark = meta.get(MARK_KEY) if isinstance(meta, dict) else None
    return mark if isinstance(mark, str) else None


def _open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (never blocks on a FIFO, never follows
    a link); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return os.fdopen(fd, "rb")


def protected_roots(storage: Storage, ckpt_dir: str) -> list[str]:
    """The local checkpoint root ``ckpt_dir`` lies in (nothing for an object store)."""
    where = storage.describe(ckpt_dir)
    return [] if "://" in where else [os.path.dirname(where.rstrip("/"))]


def remove_earlier(first: str, shards: set[str]) -> None:
    """Remove ``first``, then each of ``shards``, each only if it is a regular file an export
    marked (never a link): the files of the export a forced one replaced, that it did not
    overwrite; left alone they would sit beside the new export as if current."""
    for old in [os.path.abspath(first), *sorted(shards)]:
        if not os.path.islink(old) and os.path.isfile(old) and file_mark(old) is not None:
            os.remove(old)


def listed_shards(index_path: str) -> set[str]:
    """The files an earlier export's index names (absolute paths; none without an index)."""
    if file_mark(index_path) is None:
        return set()
    try:
        with _open_regular(index_path) as f:
            weight_map = json.loads(f.read(_MAX_HEADER)).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return set()
    head = os.path.dirname(os.path.abspath(index_path))
    return {
        os.path.join(head, name)
        for name in weight_map.values()
        if isinstance(name, str) and name == os.path.basename(name)  # never outside the directory
    }
