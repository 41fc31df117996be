"""The supervisor: ``crashproof run`` and the trainer's side of it (heartbeats, stack dumps).

``launch`` runs the job from ``crashproof run``'s options (parsed by :mod:`crashproof.cli`)
under ``_agent.CrashproofAgent`` (torch elastic's local agent, extended); ``_heartbeat``,
``_hang`` and ``_crashloop`` hold the facts and decisions; ``_worker`` and ``_entry`` run inside
the trainers.
"""

from __future__ import annotations

from crashproof.link import heartbeat

__all__ = ["heartbeat"]
