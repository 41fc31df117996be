"""The agent's memory host: it holds its trainers' newest snapshots in shared memory, so that a
trainer that crashes leaves its state behind in RAM for the trainer restarted in its place.

Each trainer's staging buffers are a segment this host creates (``memfd_create``: anonymous
memory with no name in ``/dev/shm``) and hands over as a file descriptor; the trainer maps it and
copies its snapshots into it. The host keeps the descriptor, so the memory outlives the trainer,
and the list of what each segment holds: a snapshot counts once the trainer *commits* it (the
index and manifest of that rank's part, kept here) and stops counting as soon as the trainer
starts to overwrite it (*invalidate*, answered before a byte is copied). A trainer killed
mid-copy therefore leaves a segment that is never offered.

Nothing leaks: the memory is freed by the kernel when the last descriptor and mapping go. The
host closes its descriptors when the run ends; a SIGKILL of the agent closes them too, and its
trainers die with it (they watch their parent), taking their mappings along.

Memory is checked before a segment is made, for the node as a whole (one request at a time), and
the segment's pages are committed at once (``posix_fallocate``), so a node out of memory refuses
the request with a message instead of killing a trainer with SIGBUS at its first snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from crashproof import _host_memory
from crashproof._host_memory import HEADROOM_BYTES
from crashproof.checkpoint.memory import check_held
from crashproof.errors import CorruptCheckpointError
from crashproof.link import ENV_MEMORY_SOCKET, memory_listener, recv_message, send_message
from crashproof.supervisor._memory_peers import Peers
from crashproof.supervisor._peer_copy import Key
from crashproof.supervisor._peer_requests import whole
from crashproof.supervisor._segment_holders import other_holders
from crashproof.telemetry import EventLog

__all__ = ["MemoryHost"]

log = logging.getLogger("crashproof.supervisor")


class _Copy(NamedTuple):
    """A copy :meth:`MemoryHost.store_copies` is to make, as its record says."""

    key: Key
    nbytes: int
    world_size: int
    step: int
    contents: dict[str, Any]
    as_replica: bool


class _Batch:
    """One :meth:`MemoryHost._check`'s snapshots: the keys it holds as being checked."""

    __slots__ = ("settled",)

    def __init__(self) -> None:
        self.settled = False


class _Held(NamedTuple):
    """A snapshot :meth:`MemoryHost._check` is to check, as it was when picked."""

    key: Key
    segment: _Segment
    stamp: tuple[int, int]  # its (gen, handed) then
    batch: _Batch


@dataclass(slots=True)
class _Segment:
    fd: int
    nbytes: int
    world_size: int
    step: int | None = None
    """The committed snapshot's step; None while none is (never yet, or being overwritten)."""
    files: dict[str, Any] = field(default_factory=dict)
    """What the trainer committed beside the bytes (its part's index and manifest, the shard's
    place in the segment), kept as sent."""
    gen: int = 0
    """Changes at every invalidate and commit: a copy read meanwhile is not whole."""
    origin: str = "local"
    """``local`` (this node's trainer wrote it) or ``peer:<node>`` (copied from that node)."""
    checked_gen: int | None = None
    """The ``gen`` at which this host checked every byte of the snapshot (see
    :meth:`MemoryHost.trainers_stopped`): offered as ``verified`` while ``gen`` is unchanged, to
    the next trainer that says hello, and to it only (it holds the segment from then on)."""
    handed: int = 0
    """How many times the segment was handed to a trainer: a check that began before the last
    hand-out vouches for nothing."""


class MemoryHost:
    """Serves ``hello``, ``allocate``, ``invalidate`` and ``commit`` requests from this node's
    trainers (see :mod:`crashproof.checkpoint.memory`) on a thread of the agent."""

    def __init__(self, events: EventLog, *, limit_bytes: int | None = None) -> None:
        self._events = events
        self._limit = limit_bytes
        self._segments: dict[Key, _Segment] = {}
        self._replicas: dict[Key, _Segment] = {}  # other nodes' ranks' snapshots, copied here
        self._filling = 0  # bytes of copies being received, not kept yet
        self._pinned: dict[str, int] = {}  # per root key: the newest step the peers cover
        self._sending: dict[Key, int] = {}  # segments being sent to peers (how many sends)
        self._preparing: dict[tuple[str, int, int], threading.Lock] = {}  # see prepare()
        self._greeted: dict[tuple[str, int, int], int] = {}  # -> the round of the last hello
        self.peers: Peers | None = None
        self._lock = threading.Lock()
        self._unsure: dict[Key, _Batch] = {}  # segments being checked, by which check
        self._checks = 0  # checks running (each of several segments)
        self._checks_done = threading.Condition(self._lock)  # notified as each check ends
        self._closed = False
        self.token = secrets.token_hex(8)
        """In the name of every segment of this host (``memfd:crashproof:<token>:...`` in
        ``/proc/<pid>/maps``): which run's memory it is."""
        self.address = f"@crashproof-memory-{os.getpid()}-{self.token}"
        self._server = memory_listener(self.address)
        self._connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="crashproof-memory", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        """Tell the trainers started from now on where to find this host."""
        os.environ[ENV_MEMORY_SOCKET] = self.address

    def replicate_to_peers(
        self,
        replicas: int | None,
        advertise: str,
        *,
        parity: int | None = None,
        bandwidth: int | None = None,
    ) -> Peers:
        """Copy committed snapshots to ``replicas`` other nodes' agents, or keep ``parity`` of
        them there (a multi-node run; neither: see :class:`Peers`), sending at most
        ``bandwidth`` bytes a second: the agent calls :meth:`Peers.join_round` after each
        rendezvous."""
        self.peers = Peers(
            self,
            self._events,
            replicas=replicas,
            parity=parity,
            advertise=advertise,
            bandwidth=bandwidth,
        )
        return self.peers

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        segments = [*self._segments.values(), *self._replicas.values()]
        parity = 0 if self.peers is None else self.peers.holder.nbytes
        return sum(s.nbytes for s in segments) + self._filling + parity

    def close(self) -> None:
        """Free every segment (the trainers have exited) and stop serving."""
        if self.peers is not None:
            self.peers.close()
        with self._lock:
            self._closed = True
            segments = [*self._segments.values(), *self._replicas.values()]
            self._segments, self._replicas = {}, {}
            connections, self._connections = self._connections, []
        for segment in segments:
            os.close(segment.fd)
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        os.environ.pop(ENV_MEMORY_SOCKET, None)

    # -- serving -----------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return  # closed
            if not _same_user(connection):
                connection.close()
                continue
            with self._lock:
                if self._closed:
                    connection.close()
                    return
                self._connections.append(connection)
            threading.Thread(
                target=self._converse,
                args=(connection,),
                name="crashproof-memory-conn",
                daemon=True,
            ).start()

    def _converse(self, connection: socket.socket) -> None:
        try:
            while True:
                message, fds = recv_message(connection)
                for fd in fds:  # a trainer sends none: a confused client's are not kept
                    os.close(fd)
                reply, out = self._answer(message)
                try:
                    send_message(connection, reply, out)
                finally:
                    for fd in out:  # (duplicates: the trainer has its own now)
                        os.close(fd)
        except (OSError, ValueError):  # (ConnectionError is an OSError: the trainer went)
            pass
        except Exception:  # a bug must not pass silently; the other connections go on
            log.exception("the memory host failed to answer a trainer")
        finally:
            with self._lock:
                if connection in self._connections:
                    self._connections.remove(connection)
            connection.close()

    def _answer(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        try:
            kind = message["op"]
            key, rank = str(message["key"]), _whole(message, "rank", _MAX_RANK)
            world_size = _whole(message, "world_size", _MAX_RANK, low=1)
            if kind == "hello":
                return self._hello(key, rank, world_size)
            if kind == "pinned":
                with self._lock:
                    sending = sorted(s for k, r, s in self._sending if (k, r) == (key, rank))
                    return {"ok": True, "step": self._pinned.get(key), "sending": sending}, []
            slot = _whole(message, "slot", _MAX_SLOT)
            if kind == "allocate":
                return self._allocate(key, rank, slot, _whole(message, "nbytes", 1 << 50), message)
            if kind == "commit":  # (read whole before anything changes)
                files, committed = dict(message["files"]), _whole(message, "step", 1 << 62)
            with self._lock:
                segment = self._segments.get((key, rank, slot))
                if segment is None:
                    return {"error": f"no segment for rank {rank} slot {slot}"}, []
                if kind == "invalidate":
                    segment.step, segment.files = None, {}
                    segment.gen += 1
                elif kind == "commit":
                    segment.world_size, segment.files, segment.step = world_size, files, committed
                    segment.gen += 1
                    segment.origin = "local"
                else:
                    return {"error": f"unknown request {kind!r}"}, []
                world_size, step = segment.world_size, segment.step
            if kind == "commit" and self.peers is not None and step is not None:
                self.peers.replicate((key, rank, slot), world_size, step)
            return {"ok": True}, []
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            return {"error": f"malformed request: {type(exc).__name__}: {exc}"}, []

    def _hello(self, key: str, rank: int, world_size: int) -> tuple[dict[str, Any], list[int]]:
        """The segments a (re)started trainer already has, with what each holds: this node's,
        else the copies it holds of another node's (the rank moved here), else copies fetched
        from a peer (this node replaces a lost one); and whether this host checked each."""
        self.prepare(key, rank, world_size)
        slots, fds = [], []
        with self._lock:  # (done long before, as a rule: the trainer imported torch)
            self._checks_done.wait_for(lambda: not self._newest_unsure(key, rank), _CHECK_WAIT_S)
            for (k, r, slot), segment in sorted(self._segments.items()):
                if k != key or r != rank:
                    continue
                if segment.world_size != world_size:
                    segment.step, segment.files = None, {}  # another world: never offered
                    segment.gen += 1
                    segment.world_size = world_size  # (what it holds next is this world's)
                slots.append(
                    {"slot": slot, "nbytes": segment.nbytes, "step": segment.step,
                     "files": segment.files, "origin": segment.origin,
                     "verified": segment.checked_gen == segment.gen}
                )  # fmt: skip
                # Its holder now could write it (and fork): checked again after it has stopped.
                segment.handed, segment.checked_gen = segment.handed + 1, None
                try:
                    fds.append(os.dup(segment.fd))
                except BaseException:  # (out of descriptors: none of these is sent)
                    for fd in fds:
                        os.close(fd)
                    raise
        return {"ok": True, "slots": slots}, fds

    def trainers_stopped(self) -> None:
        """Every process this agent started for its trainers has stopped: check each committed
        snapshot now, on threads, while the next trainers start. Only if no other process
        holds a segment (``/proc``: a leftover that escaped its session and its parent still
        could write it): then no one can change the bytes but this host, which hands the next
        trainers descriptors they map read-only until they tell it they write. What checks out
        is offered to them as ``verified``, and their restore copies it without hashing it
        again; what does not is never offered. A hello waits for its rank's newest snapshot."""
        held = self._unchecked(lambda key, segment: True)
        if not held:
            return
        try:
            threading.Thread(
                target=self._check, args=(held,), name="crashproof-memory-check", daemon=True
            ).start()
        except BaseException:
            self._settle(held)
            raise

    def _newest_unsure(self, key: str, rank: int) -> bool:
        """Whether the newest snapshot of (key, rank) is being checked (under the lock). A
        restore takes that one as a rule; an older one not checked yet is hashed by it."""
        mine = [(k, s) for k, s in self._segments.items()
                if k[:2] == (key, rank) and s.step is not None]  # fmt: skip
        newest = max((s.step for _, s in mine if s.step is not None), default=None)
        return any(k in self._unsure and s.step == newest for k, s in mine)

    def checks_done(self, timeout: float) -> bool:
        """Wait until no check of :meth:`trainers_stopped` is running; whether none is."""
        with self._lock:
            return self._checks_done.wait_for(lambda: not self._checks, timeout)

    def _unchecked(self, which: Callable[[Key, _Segment], bool]) -> list[_Held]:
        """This node's committed snapshots ``which`` selects, not checked and not being
        checked, as they are now, newest step first; marked as being checked (the caller
        checks them: :meth:`_check`)."""
        with self._lock:
            if self._closed:
                return []
            batch = _Batch()
            held = [_Held(key, segment, (segment.gen, segment.handed), batch)
                    for key, segment in self._segments.items()
                    if segment.step is not None and segment.checked_gen != segment.gen
                    and key not in self._unsure and which(key, segment)]  # fmt: skip
            self._unsure.update((h.key, batch) for h in held)
            self._checks += 1 if held else 0
        return sorted(held, key=lambda h: -(h.segment.step or 0))

    def _check(self, held: list[_Held], *, copies: bool = False) -> None:
        """Check ``held``, two at a time, if no other process can write them; what is damaged
        is never offered. ``copies``: copies this host has fetched or rebuilt; what fails is
        left to the restore, which refuses it as it always has."""
        started = time.monotonic()
        try:
            with self._lock:  # (a segment's descriptor is closed when it is replaced)
                inodes = {
                    os.fstat(h.segment.fd).st_ino: h.key
                    for h in held
                    if self._segments.get(h.key) is h.segment
                }
            holders = other_holders(self.token, set(inodes))
            if holders:  # (their restore hashes them, as without this check)
                pids = sorted({pid for found in holders.values() for pid in found})
                log.warning("processes %s still hold some of this agent's memory segments (a "
                            "trainer's leftovers?): their snapshots are left to the restore to "
                            "check", pids)  # fmt: skip
            held_back = {inodes[inode] for inode in holders}
            self._release([h for h in held if h.key in held_back])  # (their hellos go on)
            self._check_all([h for h in held if h.key not in held_back], started, not copies)
        except Exception:  # (a bug: the restore checks them itself, as before)
            log.exception("checking the snapshots in this agent's memory failed")
        finally:
            self._settle(held)

    def _settle(self, held: list[_Held]) -> None:
        """``held`` (one check's) are checked, or never will be: hellos waiting go on. Once."""
        with self._lock:
            if not held or held[0].batch.settled:
                return
            held[0].batch.settled = True
            self._checks -= 1
        self._release(held)

    def _release(self, held: list[_Held]) -> None:
        """No longer being checked by their check (a later check's claim is left alone)."""
        with self._lock:
            for h in held:
                if self._unsure.get(h.key) is h.batch:
                    del self._unsure[h.key]
            self._checks_done.notify_all()

    def _check_all(self, held: list[_Held], started: float, drop: bool) -> None:
        with ThreadPoolExecutor(2, thread_name_prefix="crashproof-memory-check") as pool:
            results = list(pool.map(lambda h: self._check_one(h, drop=drop), held))
        if any(r is not None for r in results):
            self._events.emit(
                "memory_checked",
                snapshots=sum(1 for r in results if r),
                bytes=sum(r or 0 for r in results),
                seconds=round(time.monotonic() - started, 4),
            )

    def _check_one(self, held: _Held, *, drop: bool) -> int | None:
        """The shard's size when the segment checked out, 0 when it did not, None when it was
        not looked at (replaced, written or handed out meanwhile)."""
        key, segment, stamp, _ = held

        def unchanged() -> bool:  # (under the lock)
            current = self._segments.get(key) is segment and not self._closed
            return current and (segment.gen, segment.handed) == stamp

        try:
            with self._lock:
                if not unchanged():
                    return None  # (replaced or written meanwhile: not this check's to judge)
                step, files, world_size = segment.step, segment.files, segment.world_size
                fd, origin, gen = os.dup(segment.fd), segment.origin, segment.gen
            assert step is not None
            try:
                check_held(fd, segment.nbytes, key, world_size, step, files, origin)
                why = None
            except CorruptCheckpointError as exc:
                why = str(exc)
            finally:
                os.close(fd)
            with self._lock:
                if not unchanged():
                    return None
                if why is None:
                    segment.checked_gen = gen
                    return int(files["shard"][1])
                if drop:  # damaged: never offered
                    segment.step, segment.files = None, {}
                    segment.gen += 1
            if drop:
                log.warning("rank %d's snapshot of step %d in this agent's memory is corrupt "
                            "and is not offered: %s", key[1], step, why)  # fmt: skip
                self._events.emit("memory_corrupt", rank=key[1], step=step, error=why)
            else:
                log.warning("rank %d's copy of step %d does not check out; the restore will "
                            "not take it: %s", key[1], step, why)  # fmt: skip
            return 0
        except Exception:  # (a bug, or no descriptor left: the restore checks it itself)
            log.exception("checking rank %d's snapshot %d in this agent's memory failed",
                          key[1], key[2])  # fmt: skip
            return None
        finally:
            self._release([held])

    def prepare(
        self, key: str, rank: int, world_size: int, *, ahead_of_round: int | None = None
    ) -> None:
        """Make sure this node holds the newest snapshots of (key, rank) any peer has: fetched
        or rebuilt when it holds none (or only older ones, kept from an earlier round). Done when
        the rank's trainer says hello, and ahead of it (``ahead_of_round``: the round's serial),
        as soon as a round forms (:meth:`Peers.join_round`). One at a time per rank; ahead of
        the trainer only: once it has said hello, its segments are its own, never replaced."""
        peers = self.peers
        if peers is None:
            return
        with self._lock:
            preparing = self._preparing.setdefault((key, rank, world_size), threading.Lock())
        copies: list[_Held] = []
        with preparing:
            if ahead_of_round is not None:
                if self._greeted.get((key, rank, world_size)) == ahead_of_round:
                    return  # (its trainer came first: what it found is what it restores from)
            else:
                self._greeted[(key, rank, world_size)] = peers.round_serial
            # What this node holds of the rank may be of an earlier round: its own snapshots or
            # its copies of another node's, kept while it waited as a spare (and a spare may be
            # taken in for any rank). A peer's newer copies then replace them; else the ranks
            # hold no step in common and every rank restores from disk.
            adopted = not self._mine(key, rank) and self._adopt_replicas(key, rank)
            newest = self._newest(key, rank)
            try:
                if newest is None:
                    peers.fetch(key, rank, world_size)
                elif peers.missed_rounds or adopted:
                    peers.fetch(key, rank, world_size, newer_than=newest)
            except Exception as exc:  # the trainer restores from storage instead
                log.warning("fetching rank %d's snapshots from a peer failed: %s", rank, exc)
            if ahead_of_round is not None:
                # Copies only this host has written (fetched, rebuilt, or kept from a peer), no
                # trainer has been handed yet: checked now, while the trainers start, not by
                # them, once the lock is let go (the hello waits for the check a bounded time).
                # (What fails is left to the restore, which refuses it as it always has.)
                copies = self._unchecked(lambda k, s: k[:2] == (key, rank) and s.origin != "local")
        if copies:
            self._check(copies, copies=True)

    def keys(self, ranks: set[int], world_size: int) -> set[str]:
        """The root keys of the committed snapshots (own or copies) of ``ranks`` this host
        holds, in a world of ``world_size``."""
        with self._lock:
            return {
                k
                for table in (self._segments, self._replicas)
                for (k, r, _), segment in table.items()
                if r in ranks and segment.step is not None and segment.world_size == world_size
            }

    def _newest(self, key: str, rank: int) -> int | None:
        """The newest step this node holds of (key, rank) as its own, or None."""
        with self._lock:
            steps = [seg.step for (k, r, _), seg in self._segments.items()
                     if k == key and r == rank and seg.step is not None]  # fmt: skip
        return max(steps, default=None)

    def _mine(self, key: str, rank: int) -> bool:
        with self._lock:
            return any(k == key and r == rank for k, r, _ in self._segments)

    def _adopt_replicas(self, key: str, rank: int) -> bool:
        """Make this node's the copies it holds of (key, rank); returns whether there were any."""
        with self._lock:
            found = [k for k in self._replicas if k[0] == key and k[1] == rank]
            for k in found:
                self._segments[k] = self._replicas.pop(k)
            return bool(found)

    # -- what the replication between nodes uses (supervisor._memory_peers) -----------------

    def has_room(self, nbytes: int) -> bool:
        with self._lock:
            room = self._room(0)
        return room is None or nbytes <= room

    def pin(self, key: str, step: int) -> None:
        with self._lock:
            self._pinned[key] = step

    def sending(self, keys: list[Key], busy: bool) -> None:
        with self._lock:
            for key in keys:
                count = self._sending.get(key, 0) + (1 if busy else -1)
                if count > 0:
                    self._sending[key] = count
                else:
                    self._sending.pop(key, None)

    def ranks(self, key: str) -> list[int]:
        """The ranks of ``key`` with segments of this node's own."""
        with self._lock:
            return sorted({r for k, r, _ in self._segments if k == key})

    def committed(self, key: str, rank: int, world_size: int) -> list[dict[str, Any]]:
        """Every committed snapshot of (key, rank) this host holds, its own or a copy: ``slot``,
        ``step``, ``nbytes``, ``contents``, ``gen`` and ``fd`` (a duplicate: the caller closes it)."""
        found: dict[int, dict[str, Any]] = {}
        with self._lock:
            for table in (self._replicas, self._segments):  # (its own win at the same slot)
                for (k, r, slot), segment in table.items():
                    if k != key or r != rank or segment.step is None:
                        continue
                    if segment.world_size != world_size:
                        continue
                    if slot in found:
                        os.close(found[slot]["fd"])
                    found[slot] = {
                        "slot": slot, "step": segment.step, "nbytes": segment.nbytes,
                        "contents": segment.files, "gen": segment.gen, "fd": os.dup(segment.fd),
                    }  # fmt: skip
        return [found[slot] for slot in sorted(found)]

    def generation(self, key: Key) -> int | None:
        with self._lock:
            segment = self._segments.get(key) or self._replicas.get(key)
            return None if segment is None else segment.gen

    def store_copy(
        self,
        key: Key,
        meta: dict[str, Any],
        fill: Callable[[memoryview], None],
        origin: str,
        *,
        as_replica: bool,
    ) -> str | None:
        return self.store_copies([(key, meta, as_replica)], lambda views: fill(views[0]), origin)

    def store_copies(
        self,
        copies: list[tuple[Key, dict[str, Any], bool]],
        fill: Callable[[list[memoryview]], None],
        origin: str,
    ) -> str | None:
        # Read before any memory is taken: a record that cannot be kept must hold none.
        wanted = [
            _Copy(key, int(meta["nbytes"]), int(meta["world_size"]), int(meta["step"]),
                  dict(meta["contents"]), as_replica)
            for key, meta, as_replica in copies
        ]  # fmt: skip
        made: list[int] = []  # the segments' descriptors, as they are made
        filling = 0  # (their bytes, counted in self._filling until they are kept or let go)
        try:
            for key, nbytes, *_, as_replica in wanted:
                with self._lock:  # (made under the lock, as a trainer's: the check holds for both)
                    table = self._replicas if as_replica else self._segments
                    old = table.get(key)
                    room = self._room(old.nbytes if old is not None else 0)
                    name = f"crashproof:{self.token}:r{key[1]}:s{key[2]}:copy"
                    fd = self._make_segment(name, nbytes, room)
                    if isinstance(fd, str):
                        self._refuse(key[1], nbytes, room, self._held(), why=fd)
                        return f"no memory for a {nbytes}-byte copy ({room} bytes available)" + (
                            f": {fd}" if fd else ""
                        )
                    self._filling += nbytes  # (counted while it fills: two cannot both pass)
                    filling += nbytes
                made.append(fd)
            with contextlib.ExitStack() as mapped:
                views = []
                for fd, copy in zip(made, wanted, strict=True):
                    mm = mapped.enter_context(
                        mmap.mmap(
                            fd, copy.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
                        )
                    )
                    views.append(memoryview(mm))
                    mapped.callback(views[-1].release)  # (before its mapping closes)
                fill(views)
            with self._lock:
                for fd, copy in zip(made, wanted, strict=True):
                    table = self._replicas if copy.as_replica else self._segments
                    old = table.pop(copy.key, None)
                    if old is not None:
                        os.close(old.fd)
                    table[copy.key] = _Segment(
                        fd, copy.nbytes, copy.world_size, copy.step, copy.contents, origin=origin
                    )
                self._filling -= filling
                filling, made = 0, []  # (kept: the table's now)
            return None
        finally:
            if filling:
                with self._lock:
                    self._filling -= filling
            for fd in made:
                os.close(fd)

    def _allocate(
        self, key: str, rank: int, slot: int, nbytes: int, message: dict[str, Any]
    ) -> tuple[dict[str, Any], list[int]]:
        """A new segment of ``nbytes`` for (rank, slot), replacing the one it had."""
        if nbytes <= 0:
            return {"error": f"cannot hold a segment of {nbytes} bytes"}, []
        with self._lock:
            old = self._segments.pop((key, rank, slot), None)
            if old is not None:
                os.close(old.fd)
            held = self._held()
            room = self._room(0)
            name = f"crashproof:{self.token}:r{rank}:s{slot}"
            fd = self._make_segment(name, nbytes, room)
            if isinstance(fd, str):
                return self._refuse(rank, nbytes, room, held, why=fd), []
            self._segments[(key, rank, slot)] = _Segment(fd, nbytes, int(message["world_size"]))
            fd_out = os.dup(fd)  # (sent once the lock is let go: this one stays the table's)
            held += nbytes
        self._events.emit(
            "memory_held", rank=rank, slot=slot, bytes=nbytes, node_bytes=held, segment=name
        )
        return {"ok": True, "nbytes": nbytes}, [fd_out]

    @staticmethod
    def _make_segment(name: str, nbytes: int, room: int | None) -> int | str:
        """A new segment of ``nbytes`` with its pages committed now (no SIGBUS at the first
        copy), or why not: more than ``room``, or the kernel's refusal."""
        if room is not None and nbytes > room:
            return ""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            return str(exc)
        return fd

    def _room(self, freed: int) -> int | None:
        """The bytes a new segment may take (None: unknown), once ``freed`` bytes are let go;
        the lock is held."""
        available = _host_memory.available_memory_bytes()
        room = None if available is None else max(0, available + freed - HEADROOM_BYTES)
        if self._limit is not None:
            left = max(0, self._limit - self._held() + freed)
            room = left if room is None else min(room, left)
        return room

    def _refuse(
        self, rank: int, nbytes: int, room: int | None, held: int, why: str = ""
    ) -> dict[str, Any]:
        self._events.emit("memory_refused", rank=rank, need=nbytes, available=room, held=held)
        return {"error": "insufficient", "need": nbytes, "available": room, "held": held,
                "limit": self._limit, "why": why}  # fmt: skip


_MAX_RANK = 1 << 24
_CHECK_WAIT_S = 15.0
"""How long a trainer's hello waits at most for :meth:`MemoryHost.trainers_stopped`'s check of
its rank's snapshots (it then gets what was checked so far; its restore hashes the rest itself):
well within the trainer's wait for the reply (``link``'s client)."""


_MAX_SLOT = 64


def _whole(message: dict[str, Any], name: str, upper: int, *, low: int = 0) -> int:
    """``message[name]``, a whole number in [low, upper); raises ``ValueError``."""
    return whole(name, message[name], low, upper - 1)


def _same_user(connection: socket.socket) -> bool:
    """Whether the process at the other end runs as this user (the abstract namespace has no
    file permissions: anyone on the host could connect)."""
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return bool(uid == os.getuid())
