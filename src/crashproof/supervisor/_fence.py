"""A lost node out of the rendezvous as soon as its neighbours see that its agent is gone.

torch's dynamic rendezvous (c10d, etcd-v2) learns that a node is lost only when its keep-alives
stop: ``keep_alive_interval`` x ``keep_alive_max_attempt`` seconds (3 s with crashproof's
defaults) during which the survivors wait, and a hot spare waits too, since it is taken in only
once the lost node's place is free. Seconds of every node's time, at each loss.

Each agent therefore listens on a port of its own and, after each rendezvous, publishes it in the
round's store beside its name in the rendezvous. When its trainers fail, before it meets the
others again, an agent knocks on the ports of its neighbours in the ring (the nodes of group
rank +-1 and +-2): a connection *refused* means the host is up and no agent listens there any
more (the agent was killed, or crashed, with its trainers). Such a node is expired from the
rendezvous at once, as its missing keep-alives would have expired it later, and the survivors
and any spare go on without waiting. A port that does not answer (a host that is gone) decides
nothing: the keep-alives do, as before. A live agent always accepts, so a node that is merely
slow is never fenced; and only a neighbour this agent once reached is ever fenced, so a port a
firewall rejects, or an address that leads elsewhere, never makes a live node look lost.

The expiry writes torch's rendezvous state through a state holder of its own (compare-and-set
on the backend, as torch's own nodes do); it uses torch's private names, and where they are
missing (another kind of rendezvous, another torch) it does nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from crashproof.supervisor._rendezvous_state import update_state
from crashproof.telemetry import EventLog

__all__ = ["Fence", "expire_nodes", "poll_faster"]

log = logging.getLogger("crashproof.supervisor")

_STORE_PREFIX = "crashproof/fence"
_NEIGHBOURS = 2
"""Nodes probed on each side of the ring: a lost node is seen by up to four others."""
_PROBE_S = 0.5
_LEARN_S = 60.0
"""How long after a round its neighbours' addresses are looked for in the store."""
_LONG_AGO = datetime(1970, 1, 1, tzinfo=timezone.utc)
_POLL_S = 0.1
_FAST_POLLS_UP_TO = 64
"""Nodes up to which the rendezvous looks at its state every ``_POLL_S``, not every second."""

NodeKey = tuple[str, int, int]
"""A node's name in torch's rendezvous: its address, its agent's pid, its local id."""


class Fence:
    """This agent's port, its neighbours of the last round, and the expiry of the lost ones."""

    def __init__(self, events: EventLog, advertise: str) -> None:
        self._events = events
        self._advertise = advertise
        self._listener = socket.create_server(("", 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._round = 0
        self._reached: list[dict[str, Any]] = []
        threading.Thread(target=self._accept, name="crashproof-fence", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            connection.close()

    def close(self) -> None:
        # (shutdown wakes the accepting thread, and the port is free at once)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()

    def join_round(self, handler: Any, store: Any, group_rank: int, nodes: int) -> None:
        """Publish this agent in the store of the round just completed; in the background, learn
        its neighbours' and reach each once."""
        me = getattr(handler, "_this_node", None)
        with self._lock:
            self._round += 1
            self._reached = []
            this_round = self._round
        if me is None or nodes < 2:
            return
        published = {"host": self._advertise, "port": self.port, "addr": me.addr,
                     "pid": me.pid, "local_id": me.local_id}  # fmt: skip
        store.set(f"{_STORE_PREFIX}/{group_rank}", json.dumps(published))
        offsets = range(1, min(_NEIGHBOURS, nodes // 2) + 1)
        ranks = sorted({(group_rank + s * d) % nodes for d in offsets for s in (1, -1)})
        keys = [f"{_STORE_PREFIX}/{r}" for r in ranks if r != group_rank]
        threading.Thread(
            target=self._reach, args=(store, keys, this_round), name="crashproof-fence-reach",
            daemon=True,
        ).start()  # fmt: skip

    def _reach(self, store: Any, keys: list[str], this_round: int) -> None:
        """Read each neighbour's address as it is published (never a blocking wait on the store,
        which the agent's thread shares) and connect to it once. Only a neighbour reached once
        may be fenced: a port that was never reachable (a firewall, a wrong address) says
        nothing when it refuses later."""
        deadline = time.monotonic() + _LEARN_S
        waiting = list(keys)
        while waiting and time.monotonic() < deadline:
            for key in list(waiting):
                try:
                    if not store.check([key]):
                        continue
                    neighbour = json.loads(store.get(key))
                except Exception as exc:  # (a newer round began, or the store is gone)
                    log.debug("neighbour %s not learned: %s", key, exc)
                    return
                waiting.remove(key)
                if _answers(neighbour) is True:
                    with self._lock:
                        if self._round != this_round:
                            return
                        self._reached.append(neighbour)
            time.sleep(0.2 if waiting else 0)

    def _neighbours(self) -> list[dict[str, Any]]:
        """The neighbours of the last round reached once (none again until the next round)."""
        with self._lock:
            reached, self._reached = self._reached, []
            self._round += 1  # (a late _reach of that round adds nothing more)
        return reached

    def fence_lost(self, handler: Any) -> list[str]:
        """Expire from the rendezvous each neighbour whose agent is gone; returns their names.
        Called when this node's trainers failed, before it meets the others again."""
        neighbours = self._neighbours()
        if not neighbours:
            return []
        with ThreadPoolExecutor(len(neighbours)) as pool:
            answers = list(pool.map(_answers, neighbours))
        gone = [n for n, answer in zip(neighbours, answers, strict=True) if answer is False]
        if not gone:
            return []
        keys = {(str(n["addr"]), int(n["pid"]), int(n["local_id"])) for n in gone}
        try:
            expired = expire_nodes(handler, keys)
        except Exception as exc:  # (the keep-alives expire them all the same, later)
            log.warning("could not take the lost node(s) out of the rendezvous: %s", exc)
            return []
        if expired:
            self._events.emit("node_fenced", nodes=expired)
            log.warning(
                "node(s) %s lost (their agent no longer answers): taken out of the rendezvous "
                "now, not after their keep-alives time out",
                ", ".join(expired),
            )
        return expired


def _answers(neighbour: dict[str, Any]) -> bool | None:
    """Whether the neighbour's agent accepts a connection: True; False when its host refuses
    it (up, and no agent there); None when undecided (no answer in time, no route)."""
    try:
        with socket.create_connection((str(neighbour["host"]), int(neighbour["port"])), _PROBE_S):
            return True
    except ConnectionRefusedError:
        return False
    except (OSError, ValueError, KeyError):
        return None


def expire_nodes(handler: Any, keys: set[NodeKey]) -> list[str]:
    """Mark the nodes ``keys`` as long silent in the rendezvous state of ``handler`` (a torch
    ``DynamicRendezvousHandler``), so that every node drops them at its next look; returns the
    names of those marked (none: not such a handler, or already gone)."""
    marked: list[str] = []

    def mark(state: Any) -> bool:
        heartbeats = state.last_heartbeats
        victims = [n for n in heartbeats if (n.addr, n.pid, n.local_id) in keys]
        for node in victims:
            heartbeats[node] = _LONG_AGO
        marked[:] = [repr(n) for n in victims]
        return bool(victims)

    return marked if update_state(handler, mark) else []


def poll_faster(handler: Any, max_nodes: int) -> bool:
    """Make torch's rendezvous look at a round it waits on every 0.1 s instead of every second;
    returns whether it did.

    Once a lost node is fenced, what is left of a node's recovery in the rendezvous is waiting:
    the survivors and a spare each take a few steps (leave the old round, join the next, see it
    complete), and torch sleeps a second before each look. It also serves each look from the
    state it read last for a second (``handler``'s state holder caches it): a node waiting on a
    round then sees a change up to a second late, whatever the pace of its looks, so both are
    shortened. Each look is one read of the state from the store (and so is the agent's check
    for nodes waiting, between its looks at its trainers): at 64 nodes or fewer, ten a second
    from each are nothing for it; beyond, torch's pace is kept."""
    if max_nodes > _FAST_POLLS_UP_TO:
        return False
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return False
    holder = getattr(handler, "_state_holder", None)
    torch_delay = getattr(dynamic_rendezvous, "_delay", None)
    if torch_delay is None or not isinstance(getattr(holder, "_cache_duration", None), int | float):
        return False
    holder._cache_duration = _POLL_S  # type: ignore[union-attr]
    if getattr(torch_delay, "crashproof_poll", False):
        return True  # (the pace is the module's: set once)

    def delay(seconds: float | tuple[float, float]) -> None:
        torch_delay(seconds=_POLL_S if seconds == 1 else seconds)  # (only the poll's second)

    delay.crashproof_poll = True  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = delay  # type: ignore[attr-defined]
    return True
