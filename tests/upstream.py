"""The test upstream: one HTTPS server with its own CA that stands in for the providers.

It answers by ``Host`` header as the providers document their APIs (request and answer
shapes, status codes, error bodies), so adapters and the model gateway are tested against
real sockets and real TLS, through the egress client and its operator overrides
(``KESTREL_EGRESS_HOST_OVERRIDES`` points the names at this server,
``KESTREL_EGRESS_CA_BUNDLE`` trusts its CA):

  api.github.com     GET  /repos/{owner}/{repo}/issues                  200 a list of issues
                     POST /repos/{owner}/{repo}/issues/{n}/comments     201 the comment
  slack.com          POST /api/chat.postMessage                         200 {"ok": true, ...}
  api.openai.com     POST /v1/chat/completions                          plain, or SSE when
                                                                         "stream": true
  api.anthropic.com  POST /v1/messages                                  plain, or SSE

On any host: ``/redirect`` (302 to ``/landed``, which a client must never reach),
``/slow?seconds=N`` (answers after N seconds; ``&drip=1`` sends the headers at once and then
one body byte every 0.2 s), ``/huge?bytes=N`` (a body of N bytes, 16 MiB by default;
``&chunked=1`` without a Content-Length) and ``/status/{code}``.

Each provider checks the credential header it documents (GitHub and Slack and OpenAI
``Authorization: Bearer``, Anthropic ``x-api-key`` plus ``anthropic-version``) against the
accepted secrets (a JSON file read at every request: ``Upstream.expect``); a missing or wrong
one is 401 with the provider's own error body (Slack answers such errors with 200 and
``ok: false``; here it is 401 with Slack's body, so a test sees it either way).

GitHub repositories it treats specially (tests of the adapters' failure paths), in
``issues.list``: ``kestrel-upstream-error`` (500), ``kestrel-slow`` (answers after 60 s) and
``kestrel-echo-credential`` (422 whose message carries the token presented).

Model names the provider emulations treat specially (tests of failure paths):
``kestrel-upstream-error`` (500), ``kestrel-slow`` (answers after 60 s) and
``kestrel-echo-credential`` (400 whose error message carries the credential presented, as a
careless upstream might: the adapters must not pass it on) and ``kestrel-echo-credential-ok``
(an ordinary OpenAI answer whose ``system_fingerprint`` is the credential, each stream event
sent in two writes cut inside it: the gateway must not pass it on either), and
``kestrel-echo-credential-escaped`` (the same whole answer with the credential spelled in JSON
escapes, so only parsing shows it; Anthropic's stream sends it as one more text delta so
spelled). Usage is
deterministic: prompt tokens are the words of the messages (and system), the completion is
the first ``max_tokens`` words of ``REPLY``. OpenAI streams send usage only when asked with
``"stream_options": {"include_usage": true}``, as OpenAI documents.

Every request is logged (method, host, path, query, headers, body) as one JSON line before
it is answered; ``Upstream.requests(host=..., path=...)`` reads them, so tests count the
requests an upstream received.

Run as ``python -m tests.upstream --dir DIR`` (prints ``listening PORT``); the ``upstream``
fixture in tests/conftest.py starts it once per session.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

HOSTS = ("api.github.com", "slack.com", "api.openai.com", "api.anthropic.com")
# Names the certificate also covers, for tests of the generic paths on a host of their own.
EXTRA_NAMES = ("upstream.kestrel.test", "localhost")
ADAPTER_HOSTS = {
    "github": "api.github.com",
    "slack": "slack.com",
    "openai": "api.openai.com",
    "anthropic": "api.anthropic.com",
}
# The secrets accepted unless a test says otherwise (test values, nothing real).
DEFAULT_SECRETS = {
    "api.github.com": "ghp_KestrelUpstreamTestToken000000000000",
    "slack.com": "xoxb-0000000000-kestrel-upstream-test",
    "api.openai.com": "sk-kestrel-upstream-test-0000000000000000",
    "api.anthropic.com": "sk-ant-kestrel-upstream-test-000000000000",
}
REPLY = "Hello from the Kestrel test upstream."
SLOW_MODEL_SECONDS = 60
HUGE_DEFAULT_BYTES = 16 * 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]


# Certificates ------------------------------------------------------------------------------


def make_identity(base: Path, names: tuple[str, ...] = HOSTS + EXTRA_NAMES) -> dict[str, Path]:
    """A CA of its own (trustme) and a server certificate for ``names`` and 127.0.0.1."""
    import trustme  # test dependency; imported here so the server module loads without it

    ca = trustme.CA(organization_name="Kestrel test upstream CA")
    cert = ca.issue_cert(*names, "127.0.0.1")
    base.mkdir(parents=True, exist_ok=True)
    paths = {"ca": base / "upstream-ca.pem", "server": base / "upstream-server.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.private_key_and_cert_chain_pem.write_to_path(str(paths["server"]))
    return paths


# The server --------------------------------------------------------------------------------


class _Log:
    """One JSON line per request, appended in one write (O_APPEND), before the answer."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self.lock:
            os.write(self.fd, line)


def _words(text: str) -> int:
    return len(text.split())


def _completion(max_tokens: int | None) -> tuple[list[str], bool]:
    words = REPLY.split()
    if max_tokens is not None and max_tokens < len(words):
        return words[:max_tokens], True
    return words, False


def _deltas(words: list[str]) -> list[str]:
    return [word if index == 0 else f" {word}" for index, word in enumerate(words)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: UpstreamHTTPServer

    def log_message(self, *args):  # the JSON log is the record
        pass

    def setup(self) -> None:
        # The TLS handshake happens here, in the request's own thread: a client that connects
        # and never speaks must not hold up the accept loop (and everyone else's requests).
        self.request.settimeout(30)
        self.request.do_handshake()
        super().setup()

    def do_GET(self):
        self._handle()

    def do_POST(self):
        self._handle()

    def do_PUT(self):
        self._handle()

    def do_PATCH(self):
        self._handle()

    def do_DELETE(self):
        self._handle()

    # Plumbing -------------------------------------------------------------------------------

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(length) if length else b""
        self.req_headers = {key.lower(): value for key, value in self.headers.items()}
        self.host = self.req_headers.get("host", "").rsplit(":", 1)[0].strip("[]").lower()
        parts = urlsplit(self.path)
        self.route = parts.path
        self.query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        self.server.log.write(
            {
                "method": self.command,
                "host": self.host,
                "path": self.route,
                "query": parts.query,
                "headers": self.req_headers,
                "body": self.body.decode(errors="replace"),
                "at": time.time(),
            }
        )
        try:
            self._dispatch()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, TimeoutError):
            pass  # the client went away (a bound it kept); nothing to answer

    def _json(
        self, status: int, payload, headers: dict[str, str] | None = None, *, escape: str = ""
    ) -> None:
        data = json.dumps(payload).encode()
        if escape:
            # ``escape`` spelled in JSON escapes only (``\\u0073\\u006b...``): the same string
            # once parsed, never its bytes as sent.
            spelled = "".join(f"\\u{ord(char):04x}" for char in escape)
            data = data.replace(json.dumps(escape).encode(), f'"{spelled}"'.encode())
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _start_chunked(self, status: int, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _payload(self) -> dict | None:
        try:
            value = json.loads(self.body or b"null")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _accepted(self) -> list[str]:
        accepted = self.server.accepted_secrets()
        value = accepted.get(self.host, [])
        return [value] if isinstance(value, str) else list(value)

    def _dispatch(self) -> None:
        if self.route == "/redirect":
            target = self.query.get("to", "/landed")
            self._json(302, {"redirect": target}, {"Location": target})
        elif self.route == "/landed":
            self._json(200, {"landed": True})
        elif self.route == "/slow":
            self._slow()
        elif self.route == "/huge":
            self._huge()
        elif self.route.startswith("/status/") and self.route[8:].isdigit():
            self._json(int(self.route[8:]), {"status": int(self.route[8:])})
        elif self.host == "api.github.com":
            self._github()
        elif self.host == "slack.com":
            self._slack()
        elif self.host == "api.openai.com":
            self._openai()
        elif self.host == "api.anthropic.com":
            self._anthropic()
        else:
            self._json(404, {"error": f"the test upstream does not emulate {self.host!r}"})

    # Generic paths ---------------------------------------------------------------------------

    def _slow(self) -> None:
        seconds = float(self.query.get("seconds", "30"))
        if self.query.get("drip"):
            self._start_chunked(200, "application/octet-stream")
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                self._chunk(b".")
                time.sleep(0.2)
            self._end_chunked()
            return
        time.sleep(seconds)
        self._json(200, {"slow": seconds})

    def _huge(self) -> None:
        size = int(self.query.get("bytes", str(HUGE_DEFAULT_BYTES)))
        piece = b"x" * 65536
        if self.query.get("chunked"):
            self._start_chunked(200, "application/octet-stream")
        else:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
        sent = 0
        while sent < size:
            data = piece[: min(len(piece), size - sent)]
            if self.query.get("chunked"):
                self._chunk(data)
            else:
                self.wfile.write(data)
            sent += len(data)
        if self.query.get("chunked"):
            self._end_chunked()

    # GitHub (https://docs.github.com/en/rest) ---------------------------------------------

    _GITHUB_DOCS = "https://docs.github.com/rest"
    _ISSUES = re.compile(r"^/repos/([A-Za-z0-9-]+)/([A-Za-z0-9._-]+)/issues$")
    _COMMENTS = re.compile(r"^/repos/([A-Za-z0-9-]+)/([A-Za-z0-9._-]+)/issues/([0-9]+)/comments$")

    def _github(self) -> None:
        auth = self.req_headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth:
            self._json(401, {"message": "Requires authentication", **self._gh_doc(401)})
            return
        if scheme.lower() not in {"bearer", "token"} or token not in self._accepted():
            self._json(401, {"message": "Bad credentials", **self._gh_doc(401)})
            return
        issues = self._ISSUES.match(self.route)
        comments = self._COMMENTS.match(self.route)
        if issues and self.command == "GET":
            if not self._github_special(issues.group(2), token):
                self._github_issues(*issues.groups())
        elif comments and self.command == "POST":
            self._github_comment(*comments.groups())
        else:
            self._json(404, {"message": "Not Found", **self._gh_doc(404)})

    def _github_special(self, repo: str, token: str) -> bool:
        """The failure paths a test can ask for by repository name, as for models."""
        if repo == "kestrel-upstream-error":
            self._json(500, {"message": "Server Error", **self._gh_doc(500)})
            return True
        if repo == "kestrel-slow":
            time.sleep(SLOW_MODEL_SECONDS)
            self._json(200, [])
            return True
        if repo == "kestrel-echo-credential":
            self._json(
                422, {"message": f"Validation Failed for token {token}", **self._gh_doc(422)}
            )
            return True
        return False

    def _gh_doc(self, status: int) -> dict:
        return {"documentation_url": self._GITHUB_DOCS, "status": str(status)}

    def _github_issues(self, owner: str, repo: str) -> None:
        state = self.query.get("state", "open")
        per_page = int(self.query.get("per_page", "30"))
        page = int(self.query.get("page", "1"))
        base = f"https://api.github.com/repos/{owner}/{repo}"
        issues = [
            {
                "id": 1000 + number,
                "node_id": f"I_kestrel{number}",
                "url": f"{base}/issues/{number}",
                "repository_url": base,
                "html_url": f"https://github.com/{owner}/{repo}/issues/{number}",
                "number": number,
                "state": issue_state,
                "title": f"Test issue {number}",
                "body": f"The test upstream's issue {number}.",
                "user": {"login": "octocat", "id": 1, "type": "User"},
                "labels": [],
                "comments": 0,
                "created_at": "2026-01-01T00:00:00Z",
                "updated_at": "2026-01-02T00:00:00Z",
                "closed_at": "2026-01-03T00:00:00Z" if issue_state == "closed" else None,
                "author_association": "OWNER",
            }
            for number, issue_state in ((3, "open"), (2, "closed"), (1, "open"))
            if state == "all" or issue_state == state
        ]
        self._json(200, issues[(page - 1) * per_page : page * per_page])

    def _github_comment(self, owner: str, repo: str, number: str) -> None:
        payload = self._payload()
        if payload is None:
            self._json(400, {"message": "Problems parsing JSON", **self._gh_doc(400)})
            return
        if not isinstance(payload.get("body"), str) or not payload["body"]:
            self._json(
                422,
                {
                    "message": "Validation Failed",
                    "errors": [{"resource": "IssueComment", "code": "missing_field"}],
                    **self._gh_doc(422),
                },
            )
            return
        comment_id = self.server.next_id()
        base = f"https://api.github.com/repos/{owner}/{repo}"
        comment = {
            "id": comment_id,
            "node_id": f"IC_kestrel{comment_id}",
            "url": f"{base}/issues/comments/{comment_id}",
            "html_url": f"https://github.com/{owner}/{repo}/issues/{number}#issuecomment-{comment_id}",
            "issue_url": f"{base}/issues/{number}",
            "body": payload["body"],
            "user": {"login": "kestrel-bot", "id": 2, "type": "Bot"},
            "created_at": "2026-01-04T00:00:00Z",
            "updated_at": "2026-01-04T00:00:00Z",
            "author_association": "NONE",
        }
        self._json(201, comment, {"Location": comment["url"]})

    # Slack (https://api.slack.com/methods/chat.postMessage) --------------------------------

    def _slack(self) -> None:
        auth = self.req_headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if self.route != "/api/chat.postMessage":
            self._json(404, {"ok": False, "error": "unknown_method"})
            return
        if not auth:
            self._json(401, {"ok": False, "error": "not_authed"})
            return
        if scheme.lower() != "bearer" or token not in self._accepted():
            self._json(401, {"ok": False, "error": "invalid_auth"})
            return
        payload = self._payload()
        if payload is None:
            self._json(200, {"ok": False, "error": "invalid_json"})
            return
        if not payload.get("channel"):
            self._json(200, {"ok": False, "error": "channel_not_found"})
            return
        if not payload.get("text"):
            self._json(200, {"ok": False, "error": "no_text"})
            return
        ts = f"{int(time.time())}.{self.server.next_id():06d}"
        message = {
            "type": "message",
            "subtype": "bot_message",
            "text": payload["text"],
            "ts": ts,
            "bot_id": "B0KESTREL",
            "username": "kestrel",
        }
        if payload.get("thread_ts"):
            message["thread_ts"] = payload["thread_ts"]
        self._json(200, {"ok": True, "channel": "C0KESTREL1", "ts": ts, "message": message})

    # OpenAI (https://platform.openai.com/docs/api-reference/chat) ---------------------------

    def _openai_error(self, status: int, message: str, kind: str, code=None, param=None):
        error = {"message": message, "type": kind, "param": param, "code": code}
        self._json(status, {"error": error})

    def _openai(self) -> None:
        if self.route != "/v1/chat/completions" or self.command != "POST":
            self._openai_error(
                404, f"Invalid URL ({self.command} {self.route})", "invalid_request_error"
            )
            return
        auth = self.req_headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if not auth:
            self._openai_error(
                401,
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                "invalid_request_error",
            )
            return
        if scheme.lower() != "bearer" or key not in self._accepted():
            # OpenAI shows the start and the end of a wrong key; so does this.
            shown = f"{key[:3]}{'*' * max(len(key) - 7, 0)}{key[-4:]}" if len(key) > 7 else "***"
            self._openai_error(
                401,
                f"Incorrect API key provided: {shown}. You can find your API key at "
                "https://platform.openai.com/account/api-keys.",
                "invalid_request_error",
                code="invalid_api_key",
            )
            return
        payload = self._payload()
        if payload is None:
            self._openai_error(400, "We could not parse the JSON body.", "invalid_request_error")
            return
        model, messages = payload.get("model"), payload.get("messages")
        if not isinstance(model, str) or not model:
            self._openai_error(
                400, "you must provide a model parameter", "invalid_request_error", param="model"
            )
            return
        if not isinstance(messages, list) or not messages:
            self._openai_error(
                400,
                "[] is too short - 'messages'",
                "invalid_request_error",
                param="messages",
            )
            return
        if self._special_model(model, key, openai=True):
            return
        echoes = model in ("kestrel-echo-credential-ok", "kestrel-echo-credential-escaped")
        fingerprint = key if echoes else "fp_kestrel"
        prompt_tokens = max(1, sum(_words(str(m.get("content", ""))) for m in messages))
        words, truncated = _completion(payload.get("max_tokens"))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(words),
            "total_tokens": prompt_tokens + len(words),
        }
        finish = "length" if truncated else "stop"
        ident = f"chatcmpl-kestrel{self.server.next_id()}"
        created = int(time.time())
        if payload.get("stream"):
            include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
            self._openai_stream(
                ident, created, model, words, finish, usage, include_usage, fingerprint
            )
            return
        self._json(
            200,
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "system_fingerprint": fingerprint,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": " ".join(words),
                            "refusal": None,
                        },
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            },
            {"x-request-id": f"req_kestrel{created}"},
            escape=key if model == "kestrel-echo-credential-escaped" else "",
        )

    def _openai_stream(
        self, ident, created, model, words, finish, usage, include_usage, fingerprint
    ):
        def chunk(delta: dict, finish_reason=None) -> dict:
            body = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": fingerprint,
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                    }
                ],
            }
            if include_usage:
                body["usage"] = None
            return body

        events = [chunk({"role": "assistant", "content": "", "refusal": None})]
        events += [chunk({"content": text}) for text in _deltas(words)]
        events.append(chunk({}, finish))
        if include_usage:
            events.append({**chunk({}), "choices": [], "usage": usage})
        self._start_chunked(200, "text/event-stream; charset=utf-8")
        for event in events:
            data = f"data: {json.dumps(event)}\n\n".encode()
            if fingerprint != "fp_kestrel":  # the echoed credential: cut inside it
                cut = data.index(fingerprint.encode()) + len(fingerprint) // 2
                self._chunk(data[:cut])
                data = data[cut:]
            self._chunk(data)
        self._chunk(b"data: [DONE]\n\n")
        self._end_chunked()

    def _special_model(self, model: str, key: str, *, openai: bool) -> bool:
        """The failure paths a test can ask for by model name."""
        if model == "kestrel-upstream-error":
            if openai:
                self._openai_error(
                    500, "The server had an error while processing your request.", "server_error"
                )
            else:
                self._anthropic_error(500, "api_error", "Internal server error")
            return True
        if model == "kestrel-slow":
            time.sleep(SLOW_MODEL_SECONDS)
            self._json(200, {"slow": True})
            return True
        if model == "kestrel-echo-credential":
            message = f"model not found for key {key}"
            if openai:
                self._openai_error(400, message, "invalid_request_error", code="model_not_found")
            else:
                self._anthropic_error(400, "invalid_request_error", message)
            return True
        return False

    # Anthropic (https://docs.anthropic.com/en/api/messages) --------------------------------

    def _anthropic_error(self, status: int, kind: str, message: str) -> None:
        self._json(
            status,
            {"type": "error", "error": {"type": kind, "message": message}},
            {"request-id": f"req_kestrel{self.server.next_id()}"},
        )

    def _anthropic(self) -> None:
        if self.route != "/v1/messages" or self.command != "POST":
            self._anthropic_error(404, "not_found_error", "Not found")
            return
        key = self.req_headers.get("x-api-key", "")
        if not key:
            self._anthropic_error(401, "authentication_error", "x-api-key header is required")
            return
        if key not in self._accepted():
            self._anthropic_error(401, "authentication_error", "invalid x-api-key")
            return
        if not self.req_headers.get("anthropic-version"):
            self._anthropic_error(
                400, "invalid_request_error", "anthropic-version: header is required"
            )
            return
        payload = self._payload()
        if payload is None:
            self._anthropic_error(400, "invalid_request_error", "There was an issue parsing JSON")
            return
        for name in ("model", "messages", "max_tokens"):
            if name not in payload:
                self._anthropic_error(400, "invalid_request_error", f"{name}: Field required")
                return
        model, messages = payload["model"], payload["messages"]
        if not isinstance(messages, list) or not messages:
            self._anthropic_error(
                400, "invalid_request_error", "messages: at least one message is required"
            )
            return
        if self._special_model(str(model), key, openai=False):
            return
        input_tokens = max(
            1,
            sum(_words(str(m.get("content", ""))) for m in messages)
            + _words(str(payload.get("system", ""))),
        )
        words, truncated = _completion(payload.get("max_tokens"))
        stop = "max_tokens" if truncated else "end_turn"
        ident = f"msg_kestrel{self.server.next_id()}"
        if payload.get("stream"):
            escaped = key if model == "kestrel-echo-credential-escaped" else ""
            self._anthropic_stream(ident, model, words, stop, input_tokens, escaped)
            return
        self._json(
            200,
            {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "text", "text": " ".join(words)}],
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": len(words)},
            },
            {"request-id": f"req_{ident}"},
        )

    def _anthropic_stream(self, ident, model, words, stop, input_tokens, escaped="") -> None:
        """``escaped``: a credential streamed as one more text delta, spelled in JSON escapes
        only (``kestrel-echo-credential-escaped``)."""
        events: list[tuple[str, dict]] = [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": ident,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": input_tokens, "output_tokens": 1},
                    },
                },
            ),
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            ("ping", {"type": "ping"}),
        ]
        events += [
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": text},
                },
            )
            for text in _deltas(words) + ([escaped] if escaped else [])
        ]
        events += [
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": len(words)},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        self._start_chunked(200, "text/event-stream; charset=utf-8")
        for name, data in events:
            text = json.dumps(data)
            if escaped:
                spelled = "".join(f"\\u{ord(char):04x}" for char in escaped)
                text = text.replace(json.dumps(escaped), f'"{spelled}"')
            self._chunk(f"event: {name}\ndata: {text}\n\n".encode())
        self._end_chunked()


class UpstreamHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, *, log_file: Path, secrets_file: Path):
        super().__init__(("127.0.0.1", port), _Handler)
        self.log = _Log(log_file)
        self.secrets_file = secrets_file
        self._ids = iter(range(1, 10**12))
        self._ids_lock = threading.Lock()

    def accepted_secrets(self) -> dict:
        try:
            return json.loads(self.secrets_file.read_text())
        except (OSError, ValueError):
            return {}

    def next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)


def make_server(
    *, port: int, server_pem: Path, log_file: Path, secrets_file: Path
) -> UpstreamHTTPServer:
    """The server, TLS-wrapped with ``server_pem`` (key and certificate chain), not started."""
    server = UpstreamHTTPServer(port, log_file=log_file, secrets_file=secrets_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(server_pem))
    server.socket = context.wrap_socket(
        server.socket, server_side=True, do_handshake_on_connect=False
    )
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="holds the PEMs and logs")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = make_server(
        port=args.port,
        server_pem=args.dir / "upstream-server.pem",
        log_file=args.dir / "requests.jsonl",
        secrets_file=args.dir / "secrets.json",
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


# The handle tests use -----------------------------------------------------------------------


@dataclass
class Upstream:
    """A running upstream as a test sees it: where it is, how to trust and reach it, and
    what it received (since this handle was made)."""

    port: int
    directory: Path
    since: int = 0
    hosts: tuple[str, ...] = HOSTS
    _process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def ca_bundle(self) -> str:
        return str(self.directory / "upstream-ca.pem")

    @property
    def log_file(self) -> Path:
        return self.directory / "requests.jsonl"

    @property
    def secrets_file(self) -> Path:
        return self.directory / "secrets.json"

    @property
    def overrides(self) -> str:
        """The ``KESTREL_EGRESS_HOST_OVERRIDES`` value pointing every emulated host here."""
        return ",".join(f"{host}=127.0.0.1:{self.port}" for host in self.hosts)

    def env(self) -> dict[str, str]:
        """The environment a worker subprocess needs to reach this upstream."""
        return {
            "KESTREL_EGRESS_HOST_OVERRIDES": self.overrides,
            "KESTREL_EGRESS_CA_BUNDLE": self.ca_bundle,
            "KESTREL_EGRESS_OVERRIDES_IN_HOSTED": "1",
        }

    def url(self, path: str, host: str = "api.github.com") -> str:
        """The URL a client uses (the real name; the override routes it here)."""
        return f"https://{host}{path}"

    def secret(self, adapter_or_host: str) -> str:
        """The secret the upstream accepts by default for an adapter (or host)."""
        return DEFAULT_SECRETS[ADAPTER_HOSTS.get(adapter_or_host, adapter_or_host)]

    def expect(self, adapter_or_host: str, *accepted: str) -> None:
        """Accept exactly these secrets for that host from now on (read at every request)."""
        current = json.loads(self.secrets_file.read_text()) if self.secrets_file.exists() else {}
        current[ADAPTER_HOSTS.get(adapter_or_host, adapter_or_host)] = list(accepted)
        self.secrets_file.write_text(json.dumps(current))

    def reset(self) -> Upstream:
        """A handle that sees only requests from now on, with the default secrets accepted."""
        self.secrets_file.write_text(json.dumps({h: [s] for h, s in DEFAULT_SECRETS.items()}))
        return Upstream(
            port=self.port, directory=self.directory, since=len(self._lines()), hosts=self.hosts
        )

    def _lines(self) -> list[str]:
        if not self.log_file.exists():
            return []
        return [line for line in self.log_file.read_text().splitlines() if line.strip()]

    def requests(
        self, *, host: str | None = None, path: str | None = None, method: str | None = None
    ) -> list[dict]:
        """The requests received since this handle was made, optionally only those for one
        host (or adapter name), path (without the query) and method, oldest first."""
        host = ADAPTER_HOSTS.get(host, host) if host else None
        records = [json.loads(line) for line in self._lines()[self.since :]]
        return [
            record
            for record in records
            if (host is None or record["host"] == host)
            and (path is None or record["path"] == path)
            and (method is None or record["method"] == method.upper())
        ]

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)


def upstream_start(directory: Path, *, timeout_s: float = 30.0) -> Upstream:
    """Make a CA and certificate under ``directory`` and start the server as a subprocess;
    its handle once it listens. Raises RuntimeError if it does not start."""
    make_identity(directory)
    (directory / "secrets.json").write_text(
        json.dumps({host: [secret] for host, secret in DEFAULT_SECRETS.items()})
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Its errors (a client hanging up mid-handshake) go to a file: a pipe nobody reads would
    # fill up and stop the server.
    errors = directory / "upstream-stderr.log"
    with errors.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.upstream", "--dir", str(directory)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not line or not line[0].startswith("listening "):
        process.kill()
        process.wait(timeout=10)
        raise RuntimeError(f"the test upstream did not start: {errors.read_text()[-2000:]}")
    return Upstream(port=int(line[0].split()[1]), directory=directory, _process=process)


def iter_sse(chunks: Iterator[bytes]) -> Iterator[dict]:
    """Server-sent events from a byte stream, as {"event": ..., "data": ...} (tests' helper)."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            event: dict = {}
            for text in raw.decode().splitlines():
                name, _, value = text.partition(": ")
                event[name] = value
            yield event


def random_secret(prefix: str = "canary") -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


if __name__ == "__main__":
    main()
