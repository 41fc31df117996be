"""What a durable tier is: its settings, their JSON form for the agent, its status, and the
interface the manager drives each tier's replication through (:class:`Replica`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from crashproof.errors import ConfigError
from crashproof.policy import RetentionPolicy, policy_from_spec, policy_to_spec
from crashproof.storage import Storage, storage_for

__all__ = ["Replica", "Tier", "TierStatus", "open_tiers"]


@dataclass(frozen=True)
class Tier:
    """A durable copy of the checkpoints: an object-store prefix (``s3://bucket/run``), another
    filesystem, or any fsspec URI.

    Args:
        uri: where the checkpoints go; one ``step_<N>`` prefix each, as in the local root.
        keep: the tier's own retention (default: the manager's ``keep``). The newest valid
            checkpoint of the tier is never removed, nor a full checkpoint a kept delta needs.
        storage_options: for the fsspec filesystem (endpoint, credentials, timeouts, ...).
        max_backlog: while the tier is slow or down, at most this many checkpoints wait for it
            (the newest ones); older pending checkpoints are dropped for this tier and reported.
        verify: read every upload back and check every checksum before counting it durable.
        parallel: files uploaded at once (large files also go up in parallel parts).
    """

    uri: str
    keep: RetentionPolicy | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    max_backlog: int = 4
    verify: bool = True
    parallel: int = 4

    def __post_init__(self) -> None:
        if self.max_backlog < 1:
            raise ConfigError(f"Tier({self.uri!r}, max_backlog={self.max_backlog}): at least 1")
        if self.parallel < 1:
            raise ConfigError(f"Tier({self.uri!r}, parallel={self.parallel}): at least 1")

    def to_json(self) -> dict[str, Any] | None:
        """The tier for another process (the agent); None when its retention policy or options
        cannot be described in JSON (a policy class of the user's own)."""
        keep = None if self.keep is None else policy_to_spec(self.keep)
        if self.keep is not None and keep is None:
            return None
        try:
            options = json.loads(json.dumps(dict(self.storage_options)))
        except (TypeError, ValueError):
            return None
        return {
            "uri": self.uri,
            "keep": keep,
            "storage_options": options,
            "max_backlog": self.max_backlog,
            "verify": self.verify,
            "parallel": self.parallel,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Tier:
        keep = data.get("keep")
        return cls(
            uri=str(data["uri"]),
            keep=None if keep is None else policy_from_spec(keep),
            storage_options=dict(data.get("storage_options") or {}),
            max_backlog=int(data.get("max_backlog", 4)),
            verify=bool(data.get("verify", True)),
            parallel=int(data.get("parallel", 4)),
        )

    def open(self) -> tuple[str, Storage]:
        """The tier's root and storage."""
        return storage_for(self.uri, self.storage_options)


@dataclass(frozen=True)
class TierStatus:
    """Where a tier stands, as :meth:`TierReplicator.status` reports it."""

    uri: str
    newest_durable: int | None
    """The newest step whose checkpoint is complete (and verified) in the tier."""
    pending: list[int]
    """Local checkpoints waiting for the tier, newest first."""
    uploading: tuple[int, float] | None
    """The checkpoint being uploaded and since when (Unix time): a long one means a slow or
    hung store."""
    failing_since: float | None
    """Unix time of the first failure of the current outage; None while the tier works."""
    last_error: str
    uploaded: int
    bytes_uploaded: int
    dropped: list[int]
    """Checkpoints given up for this tier while it was down (the backlog was full)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "newest_durable": self.newest_durable,
            "pending": self.pending,
            "uploading": None
            if self.uploading is None
            else {"step": self.uploading[0], "since": self.uploading[1]},
            "failing_since": self.failing_since,
            "last_error": self.last_error,
            "uploaded": self.uploaded,
            "bytes_uploaded": self.bytes_uploaded,
            "dropped": self.dropped,
        }


class Replica(Protocol):
    """One tier's replication as the manager drives it: in this process (:class:`TierReplicator`)
    or by the agent of ``crashproof run`` (``AgentTier``)."""

    tier: Tier

    def notify(self) -> None: ...
    def protected(self) -> set[int]: ...
    def status(self) -> TierStatus: ...
    def wait_durable(self, timeout_s: float) -> bool: ...
    def stop(self, timeout_s: float = 5.0) -> None: ...


def open_tiers(
    remote: str | Tier | Sequence[str | Tier] | None,
) -> list[Tier]:
    """The manager's ``remote=`` argument as a list of tiers."""
    if remote is None:
        return []
    items = [remote] if isinstance(remote, str | Tier) else list(remote)
    tiers = [t if isinstance(t, Tier) else Tier(t) for t in items]
    uris = [t.uri for t in tiers]
    if len(set(uris)) != len(uris):
        raise ConfigError(f"remote={uris}: a tier is listed twice")
    return tiers
