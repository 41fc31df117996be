"""The trainer's link to its surroundings: what a training process tells ``crashproof run``'s
agent and hears from it and from the machine.

``_heartbeat`` writes the record the agent's hang detection reads; ``_reporter`` reports steps,
saves and restores as heartbeats and events; ``_worker`` attaches a trainer to its agent (stack
dumps on request, dying with the agent); ``_preemption`` turns preemption signals and cloud notices
into a notice the checkpoint manager acts on at a step boundary; ``_memory_wire`` is the socket
over which a trainer keeps its snapshots in the agent's memory. This part knows nothing of
checkpoints: the checkpoint manager and the supervisor both build on it.
"""

from __future__ import annotations

from crashproof.link._heartbeat import (
    ENV_HEARTBEAT_DIR,
    FINISHED_PHASES,
    Heartbeat,
    HeartbeatWriter,
    Phase,
    heartbeat,
    read_heartbeat,
    worker_heartbeat,
)
from crashproof.link._memory_wire import (
    ENV_MEMORY_SOCKET,
    MemoryClient,
    memory_listener,
    recv_exactly,
    recv_message,
    send_message,
)
from crashproof.link._preemption import (
    ENV_NOTICE_FILE,
    EXIT_PREEMPTED,
    PREEMPTION_SIGNALS,
    Notice,
    PreemptedExit,
    PreemptionListener,
)
from crashproof.link._reporter import SupervisedReporter, Unsupervised, trainer_reporter
from crashproof.link._worker import (
    ENV_PARENT_PID,
    STACK_DUMP_SIGNAL,
    attach_to_supervisor,
    die_with_parent,
    script_returned,
)

__all__ = [
    "ENV_HEARTBEAT_DIR",
    "ENV_MEMORY_SOCKET",
    "ENV_NOTICE_FILE",
    "ENV_PARENT_PID",
    "EXIT_PREEMPTED",
    "FINISHED_PHASES",
    "PREEMPTION_SIGNALS",
    "STACK_DUMP_SIGNAL",
    "Heartbeat",
    "HeartbeatWriter",
    "MemoryClient",
    "Notice",
    "Phase",
    "PreemptedExit",
    "PreemptionListener",
    "SupervisedReporter",
    "Unsupervised",
    "attach_to_supervisor",
    "die_with_parent",
    "heartbeat",
    "memory_listener",
    "read_heartbeat",
    "recv_exactly",
    "recv_message",
    "script_returned",
    "send_message",
    "trainer_reporter",
    "worker_heartbeat",
]
