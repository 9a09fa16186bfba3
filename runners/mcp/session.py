"""One MCP server in its container, spoken to over stdio with the MCP Python SDK.

``server_session`` creates the container from a signed profile only (``container_options``:
the tool sandboxes' hardening, RUN-3, and the profile's image id, mount, network and
limits), attaches to its stdin and stdout through ``docker start --attach --interactive``
(the SDK's ``stdio_client`` runs it, through ``line_bound.py``, which bounds a line),
initializes the session and removes the container when the session ends. ``list_tools``
and ``call_pinned`` are the two things a session is used for: listing (discovery, and the
check before every call) and one pinned call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import docker.errors
import docker.types
import requests.exceptions
from mcp import ClientSession, StdioServerParameters
from mcp import types as mcp_types
from mcp.client.stdio import stdio_client
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher

from runners.contract.canonical import canonical_json
from runners.contract.mcp import (
    MAX_OUTPUT_CHARS,
    MAX_TOOLS,
    tool_definition,
    tool_definition_digest,
)
from runners.mcp.errors import (
    McpError,
    McpImageMissing,
    McpListTooLong,
    McpProtocolError,
    McpStartFailed,
    McpStdoutRefused,
    McpTimeout,
    McpToolChanged,
    McpUnavailable,
)
from runners.mcp.network import ensure_open_network
from runners.sandbox.docker import LABEL_PREFIX, MANAGED_LABEL
from runners.workspace import workspace_owner

__all__ = [
    "MAX_LISTED_BYTES",
    "MCP_LABEL",
    "START_TIMEOUT_SECONDS",
    "bounded_result",
    "call_pinned",
    "call_pinned_checked",
    "check_pinned",
    "container_options",
    "image_volume_paths",
    "list_tools",
    "listed_tool",
    "server_session",
]

MCP_LABEL = f"{LABEL_PREFIX}mcp"
SERVER_WORKSPACE = "/workspace"
SERVER_TMP = "/tmp"  # noqa: S108 - the container's own tmpfs
# How long a server may take from its container's creation to an initialized session.
START_TIMEOUT_SECONDS = 60.0
# How much of a server's stderr (bytes) a start failure quotes, and all the runner keeps.
STDERR_TAIL_CHARS = 2000
# The longest line (one JSON-RPC message) a server may write; a longer one ends its session
# (runners/mcp/line_bound.py, between the docker command and the SDK's reader).
MAX_LINE_BYTES = 16 * 1024 * 1024
# A server's whole tool list (its definitions' canonical JSON), as listed before each call
# and at discovery, whose report carries it within the 4 MiB the control plane takes.
MAX_LISTED_BYTES = 3 * 1024 * 1024
LINE_BOUND = Path(__file__).with_name("line_bound.py")
# What the docker command needs from the runner's environment to reach the same engine.
_DOCKER_VARIABLES = ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY")
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException)
# An image's declared VOLUMEs (untrusted: a custom image is an org admin's) each become a
# tmpfs bounded like /tmp, never an engine volume on the runner host's disk. Path names are
# plain components only; anything else, or more of them, refuses the server.
MAX_IMAGE_VOLUMES = 32
_VOLUME_COMPONENT = re.compile(r"[A-Za-z0-9._@+-]{1,255}")
_KERNEL_TREES = ("proc", "sys", "dev")
# The labels of the runner's prefix that Kestrel's own image builds write (deploy/images:
# the build's inputs and stage, the image's name, the adapter client's digest), which the
# runner never reads from a container. Any other an image carries refuses the server.
IMAGE_BUILD_LABELS = frozenset(
    f"{LABEL_PREFIX}{name}" for name in ("build-inputs", "build-stage", "image", "adapter-client")
)


def image_volume_paths(image_config: Mapping[str, Any] | None) -> list[str]:
    """The paths an image declares as VOLUMEs (its ``Config.Volumes``), as the engine cleans
    them; ``McpStartFailed`` for anything but a few plain absolute paths.

    The engine gives each such path an anonymous volume on the runner host's disk, which no
    limit bounds and which outlives the container; ``container_options`` covers each with a
    tmpfs instead. The engine skips a volume whose cleaned path already has a mount, so the
    cleaned spelling is the one that must be covered.
    """
    declared = (image_config or {}).get("Volumes") or {}
    if not isinstance(declared, Mapping):
        raise McpStartFailed("the image's declared volumes are not a map of paths")
    if len(declared) > MAX_IMAGE_VOLUMES:
        raise McpStartFailed(
            f"the image declares {len(declared)} volumes; a server may have {MAX_IMAGE_VOLUMES}"
        )
    paths: set[str] = set()
    for declared_path in declared:
        refused = McpStartFailed(
            f"the image declares the volume {str(declared_path)[:200]!r}: a server's volume "
            "must be an absolute path of plain names (letters, digits, '.', '_', '@', '+', "
            "'-'), outside /proc, /sys and /dev"
        )
        if not isinstance(declared_path, str) or not declared_path.startswith("/"):
            raise refused
        parts = [part for part in declared_path.split("/") if part]
        if (
            not parts
            or parts[0] in _KERNEL_TREES
            or any(part in (".", "..") or not _VOLUME_COMPONENT.fullmatch(part) for part in parts)
        ):
            raise refused
        paths.add("/" + "/".join(parts))
    return sorted(paths)


def check_image_labels(image_config: Mapping[str, Any] | None) -> None:
    """``McpStartFailed`` if the image carries a label of the runner's own (``io.kestrel.``)
    other than those Kestrel's image builds write (``IMAGE_BUILD_LABELS``).

    The engine copies an image's labels onto every container made from it, except the keys
    the create call sets. The runner finds, adopts and cleans up its containers by those
    labels (a warm sandbox's ``warm`` and ``agent-dir``, ``mcp-warm``, ``call``, ...), and
    acts on the host paths they name, as root when it runs as root: an image must not be able
    to claim any of them."""
    declared = (image_config or {}).get("Labels") or {}
    if not isinstance(declared, Mapping):
        raise McpStartFailed("the image's labels are not a map of names")
    claimed = sorted(
        str(name)[:100]
        for name in declared
        if str(name).startswith(LABEL_PREFIX) and name not in IMAGE_BUILD_LABELS
    )
    if claimed:
        raise McpStartFailed(
            f"the image carries the label{'s' if len(claimed) > 1 else ''} "
            f"{', '.join(claimed[:5])}{', ...' if len(claimed) > 5 else ''}: names under "
            f"{LABEL_PREFIX} are the runner's own, for its containers; rebuild the image "
            "without them"
        )


def container_options(
    profile: Mapping[str, Any],
    *,
    labels: Mapping[str, str],
    workspace: Path | None,
    network: str,
    image_volumes: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """The ``containers.create`` arguments of a server: from its profile and nothing else
    but the VOLUMEs its image (run by the profile's id) declares (``image_volume_paths``),
    each a tmpfs bounded like /tmp. The profile's command is the whole argv (the image's
    ENTRYPOINT and CMD only when it is empty), and no image HEALTHCHECK runs."""
    uid, gid = workspace_owner()
    limits = profile["limits"]
    mounts = []
    if profile["workspace"] != "none":
        if workspace is None:
            raise McpStartFailed("the server's profile mounts a workspace, but there is none")
        mounts.append(
            docker.types.Mount(
                target=SERVER_WORKSPACE,
                source=str(Path(workspace).resolve(strict=True)),
                type="bind",
                read_only=profile["workspace"] == "ro",
            )
        )
    # tmpfs pages count against the container's memory limit, so each is bounded twice.
    tmpfs_options = f"rw,nosuid,nodev,size={int(limits['tmp_mb'])}m,mode=1777"
    tmpfs = {SERVER_TMP: tmpfs_options}
    for path in image_volumes:
        # The workspace's bind mount already stands where the image asked for a volume.
        if path != SERVER_WORKSPACE or not mounts:
            tmpfs.setdefault(path, tmpfs_options)
    options: dict[str, Any] = {
        "user": f"{uid}:{gid}",
        "environment": {"HOME": SERVER_TMP, "LANG": "C.UTF-8"},
        "labels": {
            **{f"{LABEL_PREFIX}{key}": str(value) for key, value in labels.items()},
            MANAGED_LABEL: "true",
            MCP_LABEL: profile["server"],
        },
        "network_mode": network,
        "read_only": True,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "ipc_mode": "private",
        "init": True,
        "pids_limit": int(limits["pids"]),
        "mem_limit": f"{int(limits['memory_mb'])}m",
        "memswap_limit": f"{int(limits['memory_mb'])}m",
        "nano_cpus": int(float(limits["cpus"]) * 1e9),
        "ulimits": [docker.types.Ulimit(name="core", soft=0, hard=0)],
        "tmpfs": tmpfs,
        "mounts": mounts,
        "log_config": docker.types.LogConfig(type="none"),
        # stdio: stdin open for the one attach, closed when it detaches (the server then
        # reads end of file and exits, whoever held the session).
        # (not detached: the engine then sets StdinOnce).
        "stdin_open": True,
        "detach": False,
        "tty": False,
        # An image's HEALTHCHECK would have the engine exec its command in the container at
        # the image's interval (1 ms at least), beside the server and outside its session:
        # processes the profile does not name, and the engine's work on the host with them.
        "healthcheck": {"test": ["NONE"]},
    }
    if profile["command"]:
        # The profile's command is the server's argv, as installed and signed: set as the
        # entrypoint, so an image's ENTRYPOINT does not run it as its arguments (a wrapper
        # nobody sees in the profile). An empty command is the image's own, both parts.
        options["entrypoint"] = list(profile["command"])
    if mounts:
        options["working_dir"] = SERVER_WORKSPACE
    return options


# A kind of log record (logger and message) is let through this often per window, then
# dropped and counted until the window ends; at most this many kinds are told apart.
RECORDS_PER_KIND = 20
RECORD_WINDOW_SECONDS = 60.0
MAX_RECORD_KINDS = 256


def record_message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # a record whose arguments do not fit its format
        return str(record.msg)


@dataclass
class _Window:
    start: float
    let_through: int = 0
    dropped: int = 0


class PerKindLimit(logging.Filter):
    """Let ``RECORDS_PER_KIND`` records of a kind through per window; the first after a
    window in which some were dropped says how many."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: dict[tuple[str, str], _Window] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg)[:100])
        with self._lock:
            if kind not in self.windows and len(self.windows) >= MAX_RECORD_KINDS:
                kind = ("", "")  # every further kind counts as one
            now = time.monotonic()
            window = self.windows.setdefault(kind, _Window(now))
            if now - window.start >= RECORD_WINDOW_SECONDS:
                dropped = window.dropped
                window.start, window.let_through, window.dropped = now, 0, 0
                if dropped:
                    said = record_message(record)
                    record.msg = f"{said} ({dropped} more like it were not logged)"
                    record.args = None
            if window.let_through >= RECORDS_PER_KIND:
                window.dropped += 1
                return False
            window.let_through += 1
            return True


# One record of the SDK's, at most (what a server sent may be in it: a method's name, an id).
MAX_SDK_RECORD_CHARS = 300


class _SdkRecords(PerKindLimit):
    """The SDK logs about what a server sent, as often as the server sends it: its stdio
    client each line of stdout that is not JSON-RPC (an error with a traceback quoting the
    line), its session each notification it cannot validate (a warning with a traceback
    quoting the notification's values), its dispatcher each response to no request and each
    method it does not know. Its records keep the exception's type only, at most
    ``MAX_SDK_RECORD_CHARS`` characters, and a few of a kind per minute."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Counted by the record's own kind (its format), before its text is rewritten.
        if not super().filter(record):
            return False
        message = record_message(record)
        if record.exc_info and record.exc_info[0] is not None:
            message = f"{message} ({record.exc_info[0].__name__})"
        if len(message) > MAX_SDK_RECORD_CHARS:
            message = f"{message[:MAX_SDK_RECORD_CHARS]} [cut]"
        record.msg, record.args = message, None
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def _bound_sdk_records() -> None:
    """Every logger of the SDK's modules loaded by now (the client, its session, stdio and
    dispatchers: all this module imports) gets the filter; a logger's filter applies to its
    own records only, not to those of the loggers below it. The SDK names its session's
    logger ``client``."""
    sdk_records = _SdkRecords()
    for name in list(logging.Logger.manager.loggerDict):
        if name in ("mcp", "client") or name.startswith("mcp."):
            logging.getLogger(name).addFilter(sdk_records)


_bound_sdk_records()


class _EveryMethod(frozenset[str]):
    """Every method name, as the dispatcher's ``inline_methods`` asks (``in``)."""

    def __contains__(self, method: object) -> bool:
        return True


class ServerSession(ClientSession):
    """The SDK's client session, with the server's requests answered one at a time in the
    read loop, and less its check of a tool's structured output against the tool's
    ``outputSchema``.

    A server may send the client requests (ping, roots, sampling, elicitation, or any other
    method, which is refused). The SDK's dispatcher answered each in a task of its own, and
    that task waits until the answer is written to the server's stdin: a server that sends
    requests and never reads its stdin had the runner hold every request it sent (1.4 GB
    for 2 GB of them, in a relay for as long as the server lives). Answered in the read loop
    (``inline_methods``, for every method), a request whose answer cannot be written stops
    the reading: the server's own writes then wait, and the call's timeout ends the session.
    None of the client's answers waits for the server, so nothing deadlocks a server that
    reads them.

    The output check runs jsonschema inside the event loop, where no timeout stops it, on a schema
    and a result the server chose: ``uniqueItems`` over 16,000 objects held a runner for four
    minutes past a 2 s timeout, and a relay's event loop (its idle and expiry watch) with it.
    A server's output is untrusted data here whatever it claims to conform to: bounded
    (``bounded_result``), then redacted and flagged by the control plane, never obeyed, so
    nothing on the runner relies on that check."""

    def __init__(
        self, read_stream: Any, write_stream: Any, *, refusals: Path | None = None
    ) -> None:
        super().__init__(
            dispatcher=JSONRPCDispatcher(read_stream, write_stream, inline_methods=_EveryMethod())
        )
        self.refusals = refusals

    def stdout_refused(self) -> McpStdoutRefused | None:
        """Why ``line_bound.py`` ended the session, if it did (``refusals``: the runner's
        file it writes its reason to, before the session sees the end of stdout)."""
        if self.refusals is None:
            return None
        try:
            with self.refusals.open(encoding="utf-8", errors="replace") as told:
                reason = told.read(500)
        except OSError:
            return None
        return McpStdoutRefused(f"{reason}; its session is ended") if reason else None

    async def validate_tool_result(self, name: str, result: mcp_types.CallToolResult) -> None:
        return None


def _docker_cli() -> str:
    cli = shutil.which("docker")
    if cli is None:
        raise McpUnavailable("MCP servers need the docker command on the runner host")
    return cli


def create_container(
    client: Any, profile: Mapping[str, Any], *, labels: Mapping[str, str], workspace: Path | None
) -> str:
    """Create (not start) the server's container; its id."""
    try:
        image = client.images.get(profile["image"])
    except docker.errors.ImageNotFound:
        raise McpImageMissing(
            f"the engine has no image {profile['image']} (installed as {profile['reference']})"
        ) from None
    except ENGINE_ERRORS as error:
        raise McpUnavailable(f"docker: no engine answers ({error})") from None
    check_image_labels(image.attrs.get("Config"))
    volumes = image_volume_paths(image.attrs.get("Config"))
    network = "none"
    if profile["network"] == "bridge":
        lapses_at = profile.get("risk_expires_at")
        if not isinstance(lapses_at, int) or time.time() >= lapses_at:
            raise McpStartFailed(
                f"the risk acceptance {profile.get('risk_acceptance')} that lets this server "
                "have a network has lapsed (or names no end): it is not started with one"
            )
        network = ensure_open_network(client)
    elif profile["network"] != "none":
        raise McpStartFailed(f"unknown network {profile['network']!r}")
    options = container_options(
        profile, labels=labels, workspace=workspace, network=network, image_volumes=volumes
    )
    try:
        return str(client.containers.create(profile["image"], **options).id)
    except ENGINE_ERRORS as error:
        raise McpStartFailed(f"docker: cannot create the server's container: {error}") from None


def remove_container(client: Any, container_id: str) -> None:
    """Remove a server's container and any anonymous volume it has (``v``): an image's
    VOLUMEs are tmpfs (``container_options``), but a container made otherwise must not
    leave one on the runner host's disk."""
    with contextlib.suppress(*ENGINE_ERRORS):
        client.api.remove_container(container_id, force=True, v=True)


@contextlib.asynccontextmanager
async def server_session(
    client: Any,
    profile: Mapping[str, Any],
    *,
    labels: Mapping[str, str],
    workspace: Path | None,
    start_timeout: float = START_TIMEOUT_SECONDS,
) -> AsyncIterator[tuple[ClientSession, mcp_types.InitializeResult, str]]:
    """An initialized session with a new server container; the container goes afterwards."""
    cli = _docker_cli()
    container_id = create_container(client, profile, labels=labels, workspace=workspace)
    env = {
        name: os.environ[name] for name in ("DOCKER_HOST", "DOCKER_CONFIG") if name in os.environ
    }
    attach = [cli, "start", "--attach", "--interactive", container_id]
    # Why line_bound.py ends the session, if it does: a file of the runner's (the server's
    # own output never reaches it), read when a request fails.
    reason_fd, reason_path = tempfile.mkstemp(prefix="kestrel-mcp-stdout-")
    os.close(reason_fd)
    refusals = Path(reason_path)
    bound = ["--max-line", str(MAX_LINE_BYTES), "--reason", reason_path]
    params = StdioServerParameters(
        command=sys.executable, args=["-I", str(LINE_BOUND), *bound, "--", *attach], env=env
    )
    initialized = False
    with StderrTail(STDERR_TAIL_CHARS) as errlog:
        try:
            async with stdio_client(params, errlog=errlog.file) as (read, write):
                async with ServerSession(read, write, refusals=refusals) as session:
                    try:
                        with anyio.fail_after(start_timeout):
                            init = await session.initialize()
                    except Exception as error:
                        why = session.stdout_refused() or _describe(error)
                        raise McpStartFailed(
                            f"the server did not initialize ({why}); its stderr "
                            f"ends: {errlog.text()!r}"
                        ) from None
                    initialized = True
                    yield session, init, container_id
        except McpStartFailed:
            raise
        except Exception as error:
            # The SDK's task groups wrap what the start, or the session's user (a listing,
            # a call), raised: that error is the answer, not the group (a caller catches
            # McpError, and reports its code and details).
            wrapped = _wrapped(error, McpStartFailed if not initialized else McpError)
            if wrapped is not None:
                raise wrapped from None
            if not initialized:
                raise McpStartFailed(
                    f"the server did not start ({_describe(error)}); its stderr ends: "
                    f"{errlog.text()!r}"
                ) from None
            raise
        finally:
            remove_container(client, container_id)
            refusals.unlink(missing_ok=True)


def _wrapped(error: BaseException, kind: type[McpError]) -> McpError | None:
    """The first ``kind`` inside ``error`` if it is an exception group, else None."""
    if not isinstance(error, BaseExceptionGroup):
        return None
    found: BaseException | None = error.split(kind)[0]
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found if isinstance(found, kind) else None


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return f"{type(error).__name__}: {str(error)[:300]}"


class StderrTail:
    """The end of a server's stderr, in memory: ``file`` is the write end of a pipe for the
    process, and a thread keeps the last ``limit`` bytes it reads.

    Never a file: a server may write to stderr for as long as its session lasts, and a
    file would grow with it on the runner host's disk.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        read_fd, write_fd = os.pipe()
        self.file = os.fdopen(write_fd, "w", encoding="utf-8")
        self._reader = os.fdopen(read_fd, "rb", buffering=0)
        self._kept = bytearray()
        self._lock = threading.Lock()
        self._drainer = threading.Thread(target=self._drain, name="mcp-stderr", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        with self._reader:
            while chunk := self._reader.read(64 * 1024):
                with self._lock:
                    self._kept += chunk
                    del self._kept[: -self.limit]

    def text(self, *, settle_s: float = 0.5) -> str:
        """What the server wrote last. A failed start quotes it: a server that has exited is
        read to its end first (at most ``settle_s``; one still running, as far as read)."""
        self._drainer.join(timeout=settle_s)
        with self._lock:
            return self._kept.decode("utf-8", errors="replace")

    def __enter__(self) -> StderrTail:
        return self

    def __exit__(self, *exc: object) -> None:
        # The process has ended, so the reader meets the end of the pipe; it goes by itself
        # should a process still hold the pipe open.
        self.file.close()
        self._drainer.join(timeout=1)


def listed_tool(tool: mcp_types.Tool) -> dict[str, Any]:
    """A listed tool as JSON, as both discovery and the check before a call digest it."""
    return tool.model_dump(mode="json", by_alias=True, exclude_none=True)


async def list_tools(session: ClientSession, *, timeout_s: float) -> list[dict[str, Any]]:
    """Every tool the server lists, following its pages, as its definition
    (``tool_definition``: what is digested, checked and reported); at most MAX_TOOLS of
    them and MAX_LISTED_BYTES in all, else ``McpProtocolError`` as soon as it is past.

    Each page is one line (MAX_LINE_BYTES), and a server may send MAX_TOOLS + 1 of them:
    kept whole, a listing could hold gigabytes in the relay before every call."""
    tools: list[dict[str, Any]] = []
    size = 0
    cursor: str | None = None
    try:
        with anyio.fail_after(timeout_s):
            for _page in range(MAX_TOOLS + 1):
                params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await session.list_tools(params=params)
                for tool in page.tools:
                    if len(tools) == MAX_TOOLS:
                        raise McpListTooLong(f"the server lists more than {MAX_TOOLS} tools")
                    definition = tool_definition(listed_tool(tool))
                    size += len(canonical_json(definition))
                    if size > MAX_LISTED_BYTES:
                        raise McpListTooLong(
                            f"the server's tool definitions exceed {MAX_LISTED_BYTES} bytes in all"
                        )
                    tools.append(definition)
                cursor = page.next_cursor
                del page  # not held while the next one is read
                if not cursor:
                    return tools
    except TimeoutError:
        raise McpTimeout("the server did not list its tools in time") from None
    except McpProtocolError:
        raise
    except Exception as error:
        raise _refused(session) or McpProtocolError(
            f"tools/list failed: {_describe(error)}"
        ) from None
    raise McpListTooLong(f"the server's tool list has more than {MAX_TOOLS} pages")


def _refused(session: ClientSession) -> McpStdoutRefused | None:
    """Why the session's stdout was refused, when a request of it failed for that."""
    return session.stdout_refused() if isinstance(session, ServerSession) else None


def check_pinned(tools: list[dict[str, Any]], *, server: str, tool: str, tool_sha256: str) -> None:
    """Refuse the call unless the server lists ``tool`` with the recorded definition."""
    listed = next((entry for entry in tools if entry.get("name") == tool), None)
    if listed is None or tool_definition_digest(listed) != tool_sha256:
        raise McpToolChanged(server, {tool: listed})


async def call_pinned(
    session: ClientSession,
    pinned: Mapping[str, Any],
    tool: str,
    arguments: Mapping[str, Any],
    *,
    timeout_s: float,
) -> dict[str, Any]:
    """List, check the tool's definition against the signed digest, then call it once:
    the listing and the call within ``timeout_s`` together."""
    deadline = anyio.current_time() + timeout_s
    tools = await list_tools(session, timeout_s=timeout_s)
    return await call_pinned_checked(
        session, pinned, tool, arguments, tools=tools, timeout_s=timeout_s, deadline=deadline
    )


async def call_pinned_checked(
    session: ClientSession,
    pinned: Mapping[str, Any],
    tool: str,
    arguments: Mapping[str, Any],
    *,
    tools: list[dict[str, Any]],
    timeout_s: float,
    deadline: float | None = None,
    before_call: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """Check the tool's definition in ``tools`` (just listed) against the signed digest,
    then call it once.

    ``timeout_s`` is the call's, and ``deadline`` (anyio's clock) when it ends: the listing
    before the call took part of it, so the call gets what is left, never ``timeout_s``
    afresh (without ``deadline``, ``timeout_s`` from now). ``before_call`` is awaited just
    before the call is sent, once nothing else can refuse it (a relay tells its worker)."""
    server = pinned["profile"]["server"]
    check_pinned(tools, server=server, tool=tool, tool_sha256=pinned["tool_sha256"])
    if deadline is None:
        deadline = anyio.current_time() + timeout_s
    if before_call is not None:
        await before_call()
    try:
        with anyio.fail_after(max(deadline - anyio.current_time(), 0.0)):
            result = await session.call_tool(tool, dict(arguments))
    except TimeoutError:
        raise McpTimeout(
            f"the tool {tool} did not answer within the call's {timeout_s:g} s "
            "(its tool list checked first)"
        ) from None
    except Exception as error:
        raise _refused(session) or McpProtocolError(
            f"tools/call failed: {_describe(error)}"
        ) from None
    return bounded_result(server, tool, result)


def bounded_result(server: str, tool: str, result: mcp_types.CallToolResult) -> dict[str, Any]:
    """The action's result: the content blocks within MAX_OUTPUT_CHARS in all, structured
    content only if it fits on its own.

    A block counts whole: its canonical JSON and the comma after it, except that a text
    block's text counts by its characters (as "262,144 characters of text" says; JSON
    escaping is for the answer's and the report's bounds to allow for), so the content's
    canonical JSON, brackets included, is within MAX_OUTPUT_CHARS when no text needs
    escaping. A text is cut to what is left once the rest of its block (type, ``_meta``,
    annotations) is counted; a block whose other parts alone do not fit, and any other
    block that does not fit whole, is dropped.
    """
    budget = MAX_OUTPUT_CHARS - len("[]") + len(",")  # n blocks have n - 1 commas
    truncated = False
    content = []
    for block in result.content:
        data = block.model_dump(mode="json", by_alias=True, exclude_none=True)
        if data.get("type") == "text" and isinstance(data.get("text"), str):
            text = data["text"]
            frame = len(canonical_json({**data, "text": ""})) + len(",")
            if frame > budget:
                truncated = True
                continue
            if frame + len(text) > budget:
                text, truncated = text[: budget - frame], True
            budget -= frame + len(text)
            content.append({**data, "text": text})
            continue
        size = len(canonical_json(data)) + len(",")
        if size > budget:
            truncated = True
            continue
        budget -= size
        content.append(data)
    structured = result.structured_content
    if structured is not None and (
        not isinstance(structured, dict) or len(canonical_json(structured)) > MAX_OUTPUT_CHARS
    ):
        structured, truncated = None, True
    return {
        "server": server,
        "tool": tool,
        "is_error": bool(result.is_error),
        "content": content,
        "structured_content": structured,
        "truncated": truncated,
    }
