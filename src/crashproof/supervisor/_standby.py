"""Hot spares: agents started beyond the run's node count, waiting warm to replace a lost node.

torch's dynamic rendezvous (c10d, etcd) keeps a node that arrives when a round already has its
``--nnodes`` maximum in a *redundancy list*: it waits there, and the next round (the survivors of
a failure meet again) takes it in place of the node that is gone. crashproof makes that wait
useful and visible:

* every agent starts its trainers' warm forkserver (torch, crashproof and ``--preload`` imported)
  while it waits in the rendezvous, so a spare that is taken in starts its trainers at once;
* a spare says so (``standby`` event) and says when it is taken in (``standby_promoted``, with
  how long it waited); its memory host then fetches or rebuilds the lost node's snapshots from
  the peers' memory, as a new node's would;
* a node left in the round's *wait list* once the round is full (it arrived, or came back from
  a restart, while another node was leaving) moves itself to the redundancy list: torch's
  rendezvous would leave it there, and the nodes in the round, seeing a node waiting, would
  restart to take it in, again and again, one node always left out. For the same reason the
  agents count a node waiting only while the round has room for it
  (:func:`count_only_nodes_with_room`);
* ``--standby N`` declares the pool of spares the run should keep: after each round, the active
  agents count the spares waiting, and a pool that fell short (a spare was used) is reported
  (``standby_pool`` event, and a warning naming how many to start).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from crashproof.supervisor._rendezvous_state import full_round, state_of, update_state
from crashproof.telemetry import EventLog

__all__ = ["Standby", "count_only_nodes_with_room", "warm_forkserver"]

log = logging.getLogger("crashproof.supervisor")

_POLL_S = 0.5
_POOL_CHECK_S = 5.0


def warm_forkserver() -> None:
    """Start the trainers' forkserver now, in the background (its imports take seconds), rather
    than when the first trainer is forked after the rendezvous."""

    def start() -> None:
        import multiprocessing.forkserver

        try:
            multiprocessing.forkserver.ensure_running()
        except Exception as exc:  # (started again, and reported, with the first trainer)
            log.debug("could not start the forkserver ahead of time: %s", exc)

    threading.Thread(target=start, name="crashproof-warm", daemon=True).start()


class Standby:
    """Watches one rendezvous of this agent: whether it waits as a spare, and the pool after."""

    def __init__(self, events: EventLog, wanted: int) -> None:
        self._events = events
        self._wanted = wanted
        self._spare_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, handler: Any) -> None:
        """The rendezvous starts: watch, in the background, whether this node becomes a spare."""
        self._stop.clear()
        self._spare_since = None
        self._thread = threading.Thread(
            target=self._watch, args=(handler,), name="crashproof-standby", daemon=True
        )
        self._thread.start()

    def _watch(self, handler: Any) -> None:
        while not self._stop.wait(_POLL_S):
            found = state_of(handler)
            if found is None:
                return
            state, node = found
            if node in state.wait_list and full_round(handler, state):
                _wait_as_spare(handler, node)
            if node in state.redundancy_list and self._spare_since is None:
                self._spare_since = time.monotonic()
                self._events.emit("standby", participants=len(state.participants))
                log.info(
                    "waiting as a hot spare: the run has its %d nodes; this node takes the "
                    "place of the first one lost",
                    len(state.participants),
                )

    @property
    def waiting(self) -> bool:
        """Whether this node waits as a spare in the rendezvous now."""
        return self._spare_since is not None

    def stop(self) -> None:
        """Stop watching (the rendezvous failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def end(self, handler: Any) -> None:
        """The rendezvous is complete and this node is in the round."""
        self.stop()
        if self._spare_since is not None:
            waited = time.monotonic() - self._spare_since
            self._events.emit("standby_promoted", waited_s=round(waited, 3))
            log.info("taken in after %.1f s as a hot spare, in place of a lost node", waited)
        if self._wanted > 0:
            # (A spare may join just after the round; torch's keep-alives refresh this node's
            # view of the rendezvous every few seconds.)
            timer = threading.Timer(_POOL_CHECK_S, self._check_pool, args=(handler,))
            timer.daemon = True
            timer.start()

    def _check_pool(self, handler: Any) -> None:
        found = state_of(handler)
        if found is None:
            return
        waiting = len(found[0].redundancy_list)
        self._events.emit("standby_pool", waiting=waiting, wanted=self._wanted)
        if waiting < self._wanted:
            log.warning(
                "%d of --standby %d hot spares are waiting: start %d more node(s) with this "
                "run's command, or the next lost node waits for a new machine",
                waiting,
                self._wanted,
                self._wanted - waiting,
            )


def _wait_as_spare(handler: Any, node: Any) -> None:
    """Move ``node`` from the wait list of a full round to its redundancy list."""

    def move(state: Any) -> bool:
        if node not in state.wait_list or not full_round(handler, state):
            return False
        state.wait_list.discard(node)
        state.redundancy_list.add(node)
        return True

    try:
        if update_state(handler, move):
            log.info("the round is full: this node waits as a spare")
    except Exception as exc:  # (the agents' own count ignores it meanwhile)
        log.debug("could not wait as a spare: %s", exc)


def count_only_nodes_with_room(handler: Any) -> None:
    """Make ``handler.num_nodes_waiting()`` (which torch's agent checks between looks at its
    trainers, restarting them to take waiting nodes in) 0 while the round is full: a node
    waiting then cannot be taken in, and restarting for it would only leave out another."""
    count = getattr(handler, "num_nodes_waiting", None)
    if count is None or state_of(handler) is None:
        return

    def num_nodes_waiting() -> int:
        waiting = int(count())  # (syncs the state first)
        found = state_of(handler)
        if waiting and found is not None and full_round(handler, found[0]):
            return 0
        return waiting

    handler.num_nodes_waiting = num_nodes_waiting
