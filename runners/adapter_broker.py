"""The broker beside the sandbox (CRED-3): a call's one way to an adapter, with no network.

For each call whose process is its own, run in its sandbox (``ToolSpec.adapter_broker``:
shell.exec, code.python), the runner opens an ``AdapterBroker``: a Unix socket in a
per-call host directory, which the sandbox backend mounts read-only at
``/run/kestrel-adapter`` (the container's network stays ``none``; bubblewrap's stays an
empty namespace) and names in ``KESTREL_ADAPTER_SOCKET``. The workload's client
(``kestrel-adapter``, on the tool image's PATH) writes one JSON request per connection.
The broker holds no credential and reaches no network: it signs the request with the
runner's key, bound to the running call and its command, sends it to the control plane
(``control.adapter_request`` on the reports queue) and waits on a list in its pool's Redis
namespace for the control plane's signed answer, at most until the call's own timeout. The
control plane makes the request an action of the call's thread, as the call's requester,
under the same policy and approvals; its answer is the action's outcome. docs/runners.md
("The adapter broker") has the design and the threat model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from runners.contract.adapter_broker import (
    MAX_ADAPTER_REQUEST_BYTES,
    MAX_REQUEST_LIFETIME_SECONDS,
    AdapterBrokerRefused,
    check_adapter_request,
    new_request_id,
    reply_key,
    sign_adapter_request,
    verify_adapter_answer,
)
from runners.contract.tokens import strict_json_loads

__all__ = [
    "ADAPTER_ROOT_VARIABLE",
    "SOCKET_NAME",
    "AdapterBroker",
    "AdapterTransport",
    "RedisAdapterTransport",
    "adapter_root_directory",
]

# The socket's name in the per-call directory; the sandbox sees the directory at
# runners.sandbox.base.SANDBOX_ADAPTER_DIR and the socket's path in KESTREL_ADAPTER_SOCKET.
SOCKET_NAME = "adapter.sock"
# Where the per-call directories go on the host.
ADAPTER_ROOT_VARIABLE = "KESTREL_ADAPTER_BROKER_DIR"

# A workload may have this many requests in flight, and make this many in one call: each
# becomes an action someone may have to decide on, so a loop must not flood the inbox.
MAX_CONCURRENT_REQUESTS = 4
MAX_REQUESTS_PER_CALL = 32
# How long the workload may take to write its request once connected.
READ_TIMEOUT_SECONDS = 10.0
# Kept back from the call's timeout so the answer reaches the workload before it is killed.
ANSWER_MARGIN_SECONDS = 1.0

log = logging.getLogger("kestrel.runner")


class AdapterTransport(Protocol):
    """How the broker reaches the control plane: send a signed request, wait for its answer."""

    def send(self, token: str) -> None: ...

    def wait(self, key: str, timeout_s: float) -> str | None: ...


@dataclass
class RedisAdapterTransport:
    """The real transport: the request as a task on the reports queue (``send_task``), the
    answer by BRPOP on the reply list, both with the runner's own broker user. One client
    (and its connection pool) per worker process, shared by its brokers' threads."""

    send_task: Callable[[str], None]
    redis_url: str
    _clients: dict[int, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def send(self, token: str) -> None:
        self.send_task(token)

    def wait(self, key: str, timeout_s: float) -> str | None:
        popped = self._client().brpop([key], timeout=max(timeout_s, 0.01))
        if popped is None:
            return None
        return popped[1].decode("ascii", errors="replace")

    def _client(self) -> Any:
        import redis  # the runner's dependency; imported here so tests of the broker need none

        with self._lock:
            client = self._clients.get(os.getpid())
            if client is None:
                # A read waits as long as BRPOP may (its own bound is the call's remaining
                # time, at most the longest request's lifetime), and not forever.
                client = redis.Redis.from_url(
                    self.redis_url,
                    socket_connect_timeout=5,
                    socket_timeout=MAX_REQUEST_LIFETIME_SECONDS + 60,
                )
                self._clients = {os.getpid(): client}  # a forked child makes its own
            return client


def adapter_root_directory(root: Path | None = None) -> Path:
    """``root`` (a backend's own: ``WarmDockerBackend.adapter_root``), else
    ``KESTREL_ADAPTER_BROKER_DIR``, else ``kestrel-adapter-<uid>`` in the temporary
    directory: mode 0711, owned by this user, so a sandbox's user (bubblewrap binds the
    per-call directory as that user) may pass through it but nobody may list it."""
    configured = os.environ.get(ADAPTER_ROOT_VARIABLE, "").strip()
    if root is None:
        root = Path(configured or Path(tempfile.gettempdir()) / f"kestrel-adapter-{os.geteuid()}")
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    info = os.lstat(root)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
        os.chmod(root, 0o711)  # noqa: S103 - whatever the umask made of it (serve's is 077)
        info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o066:
        raise OSError(
            f"{root} must be a directory of this user that others cannot list or write "
            f"(set {ADAPTER_ROOT_VARIABLE} to use another)"
        )
    return root


@dataclass
class AdapterBroker:
    """One call's broker: its socket, its requests, and nothing else (no key but the runner's
    signing key, no credential, no network).

    ``deadline`` is the call's end on ``time.monotonic()``; ``before_request`` runs once,
    before the first request is sent (the runner sends the call's "started" report there,
    so the control plane sees the call running).
    """

    call_id: str
    command_digest: str
    runner_id: str
    pool: str
    private_key: Ed25519PrivateKey
    control_public_key: Ed25519PublicKey
    transport: AdapterTransport
    deadline: float
    before_request: Callable[[], None] = field(default=lambda: None)
    root: Path | None = None
    directory: Path = field(init=False)
    requests: int = field(init=False, default=0)
    _listener: socket.socket | None = field(init=False, default=None)
    _closed: threading.Event = field(init=False, default_factory=threading.Event)
    _slots: threading.Semaphore = field(
        init=False, default_factory=lambda: threading.Semaphore(MAX_CONCURRENT_REQUESTS)
    )
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _started: bool = field(init=False, default=False)
    _thread: threading.Thread | None = field(init=False, default=None)

    @property
    def socket_path(self) -> Path:
        return self.directory / SOCKET_NAME

    def __enter__(self) -> AdapterBroker:
        root = adapter_root_directory(self.root)
        self.directory = Path(tempfile.mkdtemp(prefix="call-", dir=root))
        # The sandbox's user must reach the socket inside (it connects; it cannot create,
        # the mount is read-only); the name is random, the root unlistable.
        os.chmod(self.directory, 0o755)  # noqa: S103 - see above
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.socket_path))
            os.chmod(self.socket_path, 0o666)  # noqa: S103 - the sandbox's uid connects
            listener.listen(MAX_CONCURRENT_REQUESTS * 2)
            listener.settimeout(0.2)
        except OSError:
            listener.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._listener = listener
        self._thread = threading.Thread(
            target=self._serve, name=f"adapter-broker-{self.call_id}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop taking requests and remove the socket; a request in flight gets no answer
        (its workload has ended with the call)."""
        self._closed.set()
        if self._thread is not None:
            # Wakes the accept() the serving thread waits in with a connection of our own
            # (it then sees the broker closed and ends), so a call's end never waits out
            # the accept timeout: that wait cost every process call up to 0.2 s.
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
                wake.connect(str(self.socket_path))
        if self._thread is not None:
            self._thread.join(2)
        if self._listener is not None:
            self._listener.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- serving ------------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._closed.is_set():  # close()'s own wake-up, or a request too late
                connection.close()
                return
            threading.Thread(
                target=self._handle, args=(connection,), name="adapter-request", daemon=True
            ).start()

    def _handle(self, connection: socket.socket) -> None:
        with connection:
            if not self._slots.acquire(blocking=False):
                self._answer(
                    connection,
                    _refusal(
                        "too_many_requests",
                        f"at most {MAX_CONCURRENT_REQUESTS} adapter requests at once per call",
                    ),
                )
                return
            try:
                self._answer(connection, self._serve_one(connection))
            except Exception:
                log.exception("adapter broker of call %s failed", self.call_id)
                self._answer(connection, _refusal("broker_error", "the broker failed"))
            finally:
                self._slots.release()

    def _serve_one(self, connection: socket.socket) -> dict[str, Any]:
        try:
            raw = _read_request(connection)
        except _TooLarge:
            return _refusal(
                "request_too_large", f"a request is at most {MAX_ADAPTER_REQUEST_BYTES} bytes"
            )
        except (TimeoutError, OSError):
            return _refusal("request_unreadable", "the request was not written in time")
        try:
            request = check_adapter_request(_strict_json(raw))
        except (ValueError, RecursionError) as error:
            return _refusal("invalid_request", f"the request is not JSON: {error}"[:300])
        except AdapterBrokerRefused as refused:
            return _refusal(refused.code, refused.message)
        with self._lock:
            if self.requests >= MAX_REQUESTS_PER_CALL:
                limit = f"at most {MAX_REQUESTS_PER_CALL} adapter requests per call"
                return _refusal("too_many_requests", limit)
            self.requests += 1
            if not self._started:
                self._started = True
                self.before_request()
        remaining = self.deadline - time.monotonic() - ANSWER_MARGIN_SECONDS
        if remaining <= 0:
            return _refusal("timeout", "the call's time is up")
        request_id = new_request_id()
        token = sign_adapter_request(
            call_id=self.call_id,
            command_digest=self.command_digest,
            request=request,
            private_key=self.private_key,
            runner_id=self.runner_id,
            lifetime_s=int(remaining) + 60,
            request_id=request_id,
        )
        self._log("adapter_request_sent", request=request_id,
                  adapter=request["adapter"], operation=request["operation"])  # fmt: skip
        try:
            self.transport.send(token)
        except Exception as error:
            self._log("adapter_request_unsent", level=logging.WARNING, request=request_id,
                      error=type(error).__name__)  # fmt: skip
            return _refusal("broker_unavailable", "the control plane could not be reached")
        try:
            answer_token = self.transport.wait(reply_key(self.pool, request_id), remaining)
        except Exception as error:
            self._log("adapter_answer_lost", level=logging.WARNING, request=request_id,
                      error=type(error).__name__)  # fmt: skip
            return _refusal("broker_unavailable", "the answer could not be received")
        if answer_token is None:
            self._log("adapter_answer_timeout", request=request_id)
            return _refusal(
                "timeout",
                "no answer within the call's timeout (an external operation may still be "
                "waiting for a person's approval)",
            )
        try:
            answer = verify_adapter_answer(
                answer_token,
                control_public_key=self.control_public_key,
                pool=self.pool,
                request_id=request_id,
                call_id=self.call_id,
            )
        except AdapterBrokerRefused as refused:
            self._log("adapter_answer_refused", level=logging.WARNING, request=request_id,
                      code=refused.code)  # fmt: skip
            return _refusal("bad_answer", "the answer did not verify; it was dropped")
        self._log("adapter_answered", request=request_id, action=answer.action,
                  outcome=answer.outcome)  # fmt: skip
        return {
            "ok": answer.outcome == "succeeded",
            "action": answer.action,
            "outcome": answer.outcome,
            "result": answer.result,
            "error": answer.error,
        }

    @staticmethod
    def _answer(connection: socket.socket, answer: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            connection.settimeout(READ_TIMEOUT_SECONDS)
            connection.sendall(json.dumps(answer, separators=(",", ":")).encode() + b"\n")

    def _log(self, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
        record = {"event": event, "runner": self.runner_id, "call_id": self.call_id, **fields}
        log.log(level, json.dumps(record, sort_keys=True, default=str))


class _TooLarge(Exception):
    pass


def _read_request(connection: socket.socket) -> bytes:
    """The request: everything up to the client's end of writing, at most the bound."""
    connection.settimeout(READ_TIMEOUT_SECONDS)
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = connection.recv(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ADAPTER_REQUEST_BYTES:
            raise _TooLarge
        chunks.append(chunk)
        # A request ends with its newline too, for clients that cannot half-close.
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


def _strict_json(raw: bytes) -> Any:
    return strict_json_loads(raw.decode("utf-8"))


def _refusal(code: str, message: str) -> dict[str, Any]:
    return {
        "ok": False,
        "action": None,
        "outcome": "refused",
        "result": None,
        "error": {"code": code, "message": message},
    }
