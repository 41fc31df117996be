"""Cloud preemption notices, polled by ``crashproof run`` from the instance metadata service.

* AWS (spot): ``GET /latest/meta-data/spot/instance-action`` (IMDSv2 token first) is 404 until
  the instance is scheduled to stop, then ``{"action": "terminate", "time": "<ISO 8601>"}``
  (about two minutes ahead).
* GCP (spot / preemptible): ``GET /computeMetadata/v1/instance/preempted`` with
  ``Metadata-Flavor: Google`` says ``TRUE`` once preempted (about 30 s ahead).
* Azure (spot): ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``
  lists events; a ``Preempt`` event carries ``NotBefore`` (at least 30 s ahead).

``CRASHPROOF_METADATA_URL`` replaces the providers' base URL (tests point it at a local server
that answers like each provider). This module only polls and reports; the agent decides.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PROVIDERS", "CloudNotice", "NoticePoller", "detect_provider", "poll_once"]

log = logging.getLogger("crashproof.run")

ENV_METADATA_URL = "CRASHPROOF_METADATA_URL"
PROVIDERS = ("aws", "gcp", "azure")
_BASE = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
_DEFAULT_LEAD_S = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


@dataclass(frozen=True, slots=True)
class CloudNotice:
    provider: str
    seconds_left: float
    """Until the machine goes away, as the notice says (or the provider's usual lead time)."""


def detect_provider() -> str | None:
    """The cloud this machine runs on, from its DMI identity; None when unknown."""
    texts = []
    for name in ("sys_vendor", "product_name", "bios_vendor", "board_vendor"):
        try:
            with open(f"/sys/class/dmi/id/{name}", encoding="utf-8") as f:
                texts.append(f.read().strip().lower())
        except OSError:
            continue
    text = " ".join(texts)
    if "amazon" in text or "ec2" in text:
        return "aws"
    if "google" in text:
        return "gcp"
    if "microsoft" in text:
        return "azure"
    return None


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return int(response.status), response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _seconds_until(when: dt.datetime) -> float:
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (when - dt.datetime.now(dt.timezone.utc)).total_seconds())


def poll_once(provider: str) -> CloudNotice | None:
    """Ask ``provider``'s metadata service once; a notice if the machine is being reclaimed."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown cloud provider {provider!r}: use one of {', '.join(PROVIDERS)}")
    base = os.environ.get(ENV_METADATA_URL, _BASE[provider]).rstrip("/")
    if provider == "aws":
        status, token = _get(
            f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT"
        )
        headers = {"X-aws-ec2-metadata-token": token} if status == 200 else {}
        status, body = _get(f"{base}/latest/meta-data/spot/instance-action", headers)
        if status != 200:
            return None
        action = json.loads(body)
        when = dt.datetime.fromisoformat(str(action["time"]).replace("Z", "+00:00"))
        return CloudNotice("aws", _seconds_until(when))
    if provider == "gcp":
        status, body = _get(
            f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}
        )
        if status == 200 and body.strip().upper() == "TRUE":
            return CloudNotice("gcp", _DEFAULT_LEAD_S["gcp"])
        return None
    if provider == "azure":
        status, body = _get(
            f"{base}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"}
        )
        if status != 200:
            return None
        for event in json.loads(body).get("Events", []):
            if event.get("EventType") in ("Preempt", "Terminate"):
                not_before = event.get("NotBefore")
                left = _DEFAULT_LEAD_S["azure"]
                if not_before:
                    left = _seconds_until(email.utils.parsedate_to_datetime(not_before))
                return CloudNotice("azure", left)
    return None


class NoticePoller:
    """A daemon thread asking the metadata service every ``interval_s``; calls ``on_notice`` once."""

    def __init__(
        self, provider: str, on_notice: Callable[[CloudNotice], None], interval_s: float = 2.0
    ) -> None:
        self.provider = provider
        self._on_notice = on_notice
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crashproof-notices", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self._interval_s):
            try:
                notice = poll_once(self.provider)
            except Exception as exc:  # any bad answer: keep polling, say so
                failures += 1
                if failures in (1, 10, 100):  # say so, without flooding the log
                    log.warning("cannot read %s preemption notices: %s", self.provider, exc)
                continue
            if notice is not None:
                log.warning(
                    "%s preemption notice: the machine goes away in %.0f s",
                    notice.provider,
                    notice.seconds_left,
                )
                self._on_notice(notice)
                return

    def close(self) -> None:
        self._stop.set()
