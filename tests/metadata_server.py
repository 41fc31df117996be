"""A local HTTP server that answers like the AWS, GCP and Azure instance metadata services.

Tests point ``CRASHPROOF_METADATA_URL`` at it and flip :attr:`MetadataServer.preempted` to
announce a preemption, with the headers each provider requires checked as the real ones do.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class MetadataServer:
    def __init__(self, lead_s: float = 90.0) -> None:
        self.preempted = False
        self.lead_s = lead_s
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                server.requests.append(f"PUT {self.path}")
                if self.path == "/latest/api/token" and self.headers.get(
                    "X-aws-ec2-metadata-token-ttl-seconds"
                ):
                    self._send(200, "token-123")
                else:
                    self._send(400)

            def do_GET(self) -> None:
                server.requests.append(f"GET {self.path}")
                when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=server.lead_s)
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
                        self._send(401)
                    elif server.preempted:
                        stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
                        self._send(200, json.dumps({"action": "terminate", "time": stamp}))
                    else:
                        self._send(404)
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        self._send(403)
                    else:
                        self._send(200, "TRUE" if server.preempted else "FALSE")
                elif self.path.startswith("/metadata/scheduledevents"):
                    if self.headers.get("Metadata") != "true":
                        self._send(400)
                        return
                    events = []
                    if server.preempted:
                        events.append(
                            {
                                "EventId": "A1",
                                "EventType": "Preempt",
                                "ResourceType": "VirtualMachine",
                                "Resources": ["vm0"],
                                "EventStatus": "Scheduled",
                                "NotBefore": email.utils.format_datetime(when, usegmt=True),
                            }
                        )
                    self._send(200, json.dumps({"DocumentIncarnation": 1, "Events": events}))
                else:
                    self._send(404)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
