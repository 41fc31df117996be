"""Reading and changing the state of torch's dynamic rendezvous (c10d, etcd-v2).

The state (the round's participants, the nodes waiting, each node's last keep-alive) lives in
the rendezvous backend, and every node reads and writes it whole, with a compare-and-set. The
hot spares (:mod:`._standby`) and the fencing of lost nodes (:mod:`._fence`) need to look at it
and, now and then, to change it as torch's own nodes would. These are torch's private names:
where they are missing (another kind of rendezvous, another torch) every function here does
nothing and says so by its result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["full_round", "state_of", "update_state"]

log = logging.getLogger("crashproof.supervisor")

_CAS_TRIES = 5


def state_of(handler: Any) -> tuple[Any, Any] | None:
    """The handler's last known state and this node's name in it (None: another kind of
    rendezvous). Read only: the handler's keep-alive thread refreshes it."""
    holder, node = getattr(handler, "_state_holder", None), getattr(handler, "_this_node", None)
    state = getattr(holder, "state", None)
    if state is None or node is None or not hasattr(state, "redundancy_list"):
        return None
    return state, node


def full_round(handler: Any, state: Any) -> bool:
    """Whether the round is complete with as many nodes as the run takes (``--nnodes``' max):
    a node waiting then cannot be taken in until one is lost."""
    settings = getattr(handler, "_settings", None)
    max_nodes = getattr(settings, "max_nodes", None)
    return bool(state.complete) and max_nodes is not None and len(state.participants) >= max_nodes


def update_state(handler: Any, change: Callable[[Any], bool]) -> bool:
    """Apply ``change`` to the rendezvous state in the backend (it returns whether it changed
    anything); returns whether a change was written. Retried when another node wrote first."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            _BackendRendezvousStateHolder,
        )
    except ImportError:
        return False
    backend = getattr(getattr(handler, "_state_holder", None), "_backend", None)
    settings = getattr(handler, "_settings", None)
    if backend is None or settings is None:
        return False
    # A holder of our own: the handler's is used by its keep-alive thread meanwhile.
    holder = _BackendRendezvousStateHolder(backend, settings, cache_duration=0)
    for _ in range(_CAS_TRIES):
        holder.sync()
        if not change(holder.state):
            return False
        holder.mark_dirty()
        if holder.sync():  # (compare-and-set: False when another node wrote first)
            return True
    return False
