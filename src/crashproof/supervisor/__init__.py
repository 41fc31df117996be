"""The supervisor: the agent side of ``crashproof run`` (the trainer's side is
:mod:`crashproof.link`).

``launch`` runs the job from ``crashproof run``'s options (parsed by :mod:`crashproof.cli`)
under ``_agent.CrashproofAgent`` (torch elastic's local agent, extended), which reads its trainers' heartbeats through ``_heartbeats``, acts on their
processes through ``_trainers`` and words what it saw through ``_announce``; ``_hang``,
``_straggler`` and ``_crashloop`` hold the decisions, ``_exits`` notices exits at once, ``_cloud``
polls for preemption notices and ``_keeper`` takes every trainer down with the agent.
``_forkserver``, ``_warm_start`` and ``_entry`` run the warm start of the trainers.
"""

from __future__ import annotations

from crashproof.link import heartbeat

__all__ = ["heartbeat"]
