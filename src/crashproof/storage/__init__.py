"""Storage backends behind one small interface; see :mod:`crashproof.storage._base`."""

from __future__ import annotations

import os
import random
import urllib.parse
from collections.abc import Mapping
from typing import Any

from crashproof.errors import ConfigError
from crashproof.storage._base import ReadStream, Storage, WriteStream, read_all, write_all
from crashproof.storage._faulty import with_injected_faults
from crashproof.storage._fsspec import LOCAL_PROTOCOLS, FsspecStorage
from crashproof.storage._guarded import GuardedStorage, local_backend
from crashproof.storage._local import (
    REPLACED_PREFIX,
    TRASH_PREFIX,
    LocalStorage,
    deferring_removals,
)
from crashproof.storage._memory import MemoryStorage

__all__ = [
    "REPLACED_PREFIX",
    "TRASH_PREFIX",
    "FsspecStorage",
    "GuardedStorage",
    "LocalStorage",
    "MemoryStorage",
    "ReadStream",
    "Storage",
    "WriteStream",
    "deferring_removals",
    "local_backend",
    "local_path",
    "read_all",
    "storage_for",
    "write_all",
]


def storage_for(root: str, options: Mapping[str, Any] | None = None) -> tuple[str, Storage]:
    """The path and backend for a checkpoint root: the local filesystem for plain paths and every
    URI that names this machine's files (``file:///p``, ``file://localhost/p``, ``file:/p``,
    ``local:///p``: :func:`local_path`); fsspec for every other URI (``s3://``, ``gs://``,
    ``az://``, ``memory://``, ...), which needs fsspec and the protocol's package (``pip install
    crashproof[s3]``, ...). ``options`` go to the fsspec filesystem (credentials, endpoint,
    timeouts). A local root is returned resolved (``os.path.realpath``): a link as the root itself
    is followed, once. A URI that reaches local files some other way (``dir::``, a cache over
    ``file``) is refused: it would bypass the lock and the no-link rules of a local root."""
    path = local_path(root)
    if path is not None:
        # The root itself may be a link (to a faster disk): resolved once here, so that below it
        # nothing is ever followed through one (see LocalStorage).
        return os.path.realpath(path), _chaos(LocalStorage())
    protocol = root.split("://", 1)[0]
    # Some SDKs draw from Python's global RNG when imported or configured; that stream is the
    # training's (and in its checkpoints): leave it exactly as it was.
    rng_state = random.getstate()
    try:
        import fsspec

        fs = fsspec.filesystem(protocol, **_with_defaults(protocol, options))
        storage = FsspecStorage(fs, protocol)  # may import and configure boto3: guarded too
    except ImportError as exc:
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}.get(
            protocol, "all"
        )
        raise ConfigError(
            f"{root!r}: storage for {protocol}:// needs a package that is not installed ({exc}); "
            f"pip install 'crashproof[{extra}]'"
        ) from None
    except ConfigError as exc:
        raise ConfigError(f"{root!r}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{root!r}: unknown storage protocol {protocol!r} ({exc})") from None
    except Exception as exc:  # a protocol that needs more than a URI (dir, reference, zip, ...)
        raise ConfigError(
            f"{root!r}: {protocol}:// cannot be a checkpoint root ({type(exc).__name__}: {exc}); "
            "give a local path or an object store's URI (s3://, gs://, az://)"
        ) from None
    finally:
        random.setstate(rng_state)
    return root.rstrip("/"), _chaos(storage)


_LOCAL_SCHEMES = frozenset(LOCAL_PROTOCOLS)


def local_path(root: str) -> str | None:
    """The path ``root`` names on this machine's filesystem, or None when it is another
    storage's URI. A plain path is itself; ``file:`` and fsspec's ``local:`` URIs are read as
    RFC 8089 says (``file:///p``, ``file://localhost/p``, ``file:/p``; percent-escapes
    decoded). A file URI naming another host, or with a query or a fragment, is refused
    (:class:`ConfigError`): it names no file here."""
    scheme, colon, _ = root.partition(":")
    if not colon or scheme.lower() not in _LOCAL_SCHEMES:
        return None if "://" in root or "::" in root else root
    parts = urllib.parse.urlsplit(root)
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{root!r}: a {scheme}: URI with a query or a fragment ('?', '#') names no file; "
            "give the path itself (or escape those characters as %3F, %23)"
        )
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(
            f"{root!r}: this {scheme}: URI names the host {parts.netloc!r}, not this machine; "
            f"a local root is written {scheme}:///absolute/path or as the path itself"
        )
    path = urllib.parse.unquote(parts.path)
    if not path:
        raise ConfigError(f"{root!r}: names no path; write {scheme}:///absolute/path")
    return path


def _chaos(storage: Storage) -> Storage:
    """Inert unless a chaos campaign set ``CRASHPROOF_CHAOS_STORAGE`` (docs/chaos.md)."""
    if not os.environ.get("CRASHPROOF_CHAOS_STORAGE"):
        return storage

    return with_injected_faults(storage)


def _with_defaults(protocol: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` plus crashproof's defaults. For S3, botocore's own retries are off unless
    asked for: their jitter draws from Python's global RNG (from a background upload thread, at
    moments no run can reproduce), and crashproof retries with backoff on its own."""
    merged = dict(options or {})
    if protocol in ("s3", "s3a"):
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})  # the first attempt only
        merged["config_kwargs"] = config
    return merged
