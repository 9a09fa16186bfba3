"""A webhook consumer for the tests: an HTTPS server that verifies every delivery with the
``standardwebhooks`` library and records what it received, one JSON line per request.

Runs as its own process (``python -m tests.webhooks.consumer ...``) so deliveries cross a real
socket and TLS, or in a thread for in-process tests. The path chooses the answer:

  /ok/...        204
  /redirect/...  302 to /ok/followed (which must never be reached)
  /gone/...      410
  /fail/...      500
  /hold/...      the first request for a webhook-id is held open (the test kills the worker
                 meanwhile); later ones get 204

The secrets file maps a path prefix (``/ok/a``) to the secrets to verify with; it is read on
every request so a test can add endpoints while the consumer runs.
"""

from __future__ import annotations

import argparse
import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from standardwebhooks import Webhook, WebhookVerificationError

HOLD_SECONDS = 60


def _verified_with(secrets: list[str], body: bytes, headers: dict[str, str]) -> list[int]:
    verified = []
    for index, secret in enumerate(secrets):
        try:
            Webhook(secret).verify(body, headers)
        except WebhookVerificationError:
            continue
        verified.append(index)
    return verified


def make_handler(*, secrets_file: Path, log_file: Path):
    lock = threading.Lock()
    held: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output quiet
            pass

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            headers = {key.lower(): value for key, value in self.headers.items()}
            secrets_map = json.loads(secrets_file.read_text()) if secrets_file.exists() else {}
            secrets = next(
                (s for prefix, s in secrets_map.items() if self.path.startswith(prefix)), []
            )
            webhook_id = headers.get("webhook-id", "")
            record = {
                "path": self.path,
                "id": webhook_id,
                "headers": headers,
                "body": body.decode(errors="replace"),
                "verified_with": _verified_with(secrets, body, headers),
                "at": time.time(),
            }
            hold = False
            with lock:
                if self.path.startswith("/hold/") and webhook_id not in held:
                    held.add(webhook_id)
                    hold = True
                    record["held"] = True
                with log_file.open("a") as log:
                    log.write(json.dumps(record) + "\n")
            if hold:
                time.sleep(HOLD_SECONDS)
            if self.path.startswith("/redirect/"):
                self._answer(302, {"Location": "/ok/followed"})
            elif self.path.startswith("/gone/"):
                self._answer(410)
            elif self.path.startswith("/fail/"):
                self._answer(500)
            else:
                self._answer(204)

        def _answer(self, status: int, headers: dict | None = None):
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


def make_server(
    *, port: int, cert: Path, key: Path, secrets_file: Path, log_file: Path
) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(
        ("127.0.0.1", port), make_handler(secrets_file=secrets_file, log_file=log_file)
    )
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


def read_log(log_file: Path) -> list[dict]:
    if not log_file.exists():
        return []
    return [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--secrets", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    server = make_server(
        port=args.port, cert=args.cert, key=args.key, secrets_file=args.secrets, log_file=args.log
    )
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
