"""Cloud preemption notices, read from a local server that answers like each provider."""

from __future__ import annotations

import threading

import pytest

from crashproof.supervisor._cloud import CloudNotice, NoticePoller, poll_once
from tests.metadata_server import MetadataServer


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_no_notice_until_the_provider_announces_one(
    metadata: MetadataServer, provider: str
) -> None:
    assert poll_once(provider) is None
    metadata.preempted = True
    notice = poll_once(provider)
    assert notice is not None and notice.provider == provider
    expected = 30 if provider == "gcp" else 90  # GCP's notice has no time: its usual 30 s
    assert expected - 5 <= notice.seconds_left <= expected + 1


def test_aws_asks_for_an_imdsv2_token_first(metadata: MetadataServer) -> None:
    poll_once("aws")
    assert metadata.requests[:2] == [
        "PUT /latest/api/token",
        "GET /latest/meta-data/spot/instance-action",
    ]


def test_the_poller_reports_a_notice_once(metadata: MetadataServer) -> None:
    seen: list[CloudNotice] = []
    arrived = threading.Event()

    def on_notice(notice: CloudNotice) -> None:
        seen.append(notice)
        arrived.set()

    poller = NoticePoller("azure", on_notice, interval_s=0.05)
    try:
        metadata.preempted = True
        assert arrived.wait(10)
    finally:
        poller.close()
    assert [n.provider for n in seen] == ["azure"]


def test_an_unknown_provider_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown cloud provider"):
        poll_once("ibm")
