"""Which rank's failure is the root cause, when several end at once
(:func:`crashproof.supervisor._exits.failure_order`).

A trainer's sockets close as it exits, before its end can be seen: the peer it was in a
collective with fails of the broken connection and may be seen to end first. The end-to-end case
is ``test_run.py``'s crash loop, whose report must name the rank that really failed.
"""

from __future__ import annotations

from torch.distributed.elastic.agent.server.api import Worker

from crashproof.supervisor._exits import failure_order, lost_a_peer

GLOO_RESET = (
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:2967: Connection reset by peer. This is typically caused by a peer crashing"
)


def _workers() -> list[Worker]:
    workers = [Worker(local_rank=r, global_rank=r, world_size=2) for r in (0, 1)]
    for pid, worker in zip((100, 101), workers, strict=True):
        worker.id = pid
    return workers


def test_a_rank_failing_of_its_peers_broken_connection_comes_after_the_peer() -> None:
    rank0, rank1 = _workers()
    errors = {100: GLOO_RESET, 101: "rank 1 fails after step 12"}
    # seen in the same poll, rank 0 listed first: rank 1 is still the root cause
    assert failure_order([rank0, rank1], set(), None, {}, errors) == [rank1, rank0]
    # a rank the agent stopped comes last, even after one that lost a peer
    assert failure_order([rank0, rank1], {101}, None, {}, errors) == [rank0, rank1]
    # both lost a peer (a network fault): the order they ended in stands
    both = {100: GLOO_RESET, 101: "Write error: Broken pipe"}
    assert failure_order([rank0, rank1], set(), None, {}, both) == [rank0, rank1]


def test_what_marks_a_lost_peer() -> None:
    for said in (GLOO_RESET, "Connection closed by peer [10.0.0.2]:4000", "Broken pipe",
                 "NCCL error: remote process exited or there was a network error"):  # fmt: skip
        assert lost_a_peer(said), said
    for said in (None, "", "ValueError: bad batch", "CUDA out of memory", "exit code 3"):
        assert not lost_a_peer(said), said
