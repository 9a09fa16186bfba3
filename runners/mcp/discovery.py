"""Discovery on the runner: resolve and verify the image, start the server, list its tools.

``discover`` answers one verified ``DiscoveryRequest`` (runners.contract.mcp_discovery)
with the claims of its report: the image id run, the server's name and version, and every
tool it lists (their definitions, ``DEFINITION_FIELDS`` only, so the report is bounded and
the control plane digests exactly what the runner checks before each call), or an error.
The server runs as for a call (``runners.mcp.session``), with an empty temporary
directory as its workspace when its profile mounts one, and is removed afterwards. Its
container names this process as its owner (``owner_labels``): should the process be killed
before removing it, the next discovery or server start, or runner start, removes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import docker
import docker.errors

from runners.config import DEFAULT_MAX_CALL_SECONDS
from runners.contract.canonical import canonical_json
from runners.contract.mcp import (
    MANAGED_SERVERS,
    MAX_DESCRIPTION_CHARS,
    MAX_SCHEMA_BYTES,
)
from runners.contract.mcp_discovery import DiscoveryRequest
from runners.mcp.errors import (
    McpError,
    McpImageMismatch,
    McpImageMissing,
    McpProtocolError,
    McpTimeout,
    McpUnavailable,
)
from runners.mcp.servers import owner_labels, remove_orphaned_mcp_servers
from runners.mcp.session import ENGINE_ERRORS, START_TIMEOUT_SECONDS, list_tools, server_session
from runners.workspace import workspace_owner

__all__ = ["LIST_TIMEOUT_SECONDS", "discover", "resolve_image"]

LIST_TIMEOUT_SECONDS = 60.0
_MAX_MESSAGE_CHARS = 4000


def resolve_image(client: Any, profile: dict[str, Any], managed: str | None) -> str:
    """The id of the image the server runs from, checked against the engine.

    Managed: the id of MANAGED_SERVERS[managed]["image"] on this engine. Custom: the
    profile's image id (or, for a pulled image, the reference) must exist, and the
    reference (``REPO@sha256:DIGEST``) must name it: REPO among the image's repositories
    (RepoTags, RepoDigests) and DIGEST its id (a local image has no RepoDigests) or one of
    its repository digests.
    """
    try:
        if managed is not None:
            tag = MANAGED_SERVERS[managed]["image"]
            try:
                return str(client.images.get(tag).id)
            except docker.errors.ImageNotFound:
                raise McpImageMissing(
                    f"the managed image {tag} is not on this runner's engine "
                    "(deploy/images/mcp-servers/build.sh builds it)"
                ) from None
        reference = str(profile["reference"])
        repository, at, pinned = reference.rpartition("@")
        if not at or not repository or not pinned.startswith("sha256:"):
            raise McpImageMismatch(f"the reference {reference!r} is not REPO@sha256:DIGEST")
        try:
            image = client.images.get(profile["image"])
        except docker.errors.ImageNotFound:
            # A pulled image's reference digest is its manifest's, not its id: the engine
            # finds it by the reference; the report then names the id actually run.
            try:
                image = client.images.get(reference)
            except (docker.errors.ImageNotFound, docker.errors.APIError):
                raise McpImageMissing(
                    f"the engine has no image {profile['image']} ({reference})"
                ) from None
    except ENGINE_ERRORS as error:
        if isinstance(error, docker.errors.ImageNotFound):
            raise
        raise McpUnavailable(f"docker: no engine answers ({error})") from None
    attrs = image.attrs
    digests = list(attrs.get("RepoDigests") or [])
    repositories = {_repository_of_tag(tag) for tag in attrs.get("RepoTags") or []}
    repositories |= {entry.partition("@")[0] for entry in digests}
    if repository not in repositories:
        raise McpImageMismatch(
            f"the image {image.id} is not from {repository} (its repositories: "
            f"{', '.join(sorted(repositories)) or 'none'})"
        )
    if pinned != image.id and f"{repository}@{pinned}" not in digests:
        raise McpImageMismatch(f"{reference} does not name the image {image.id}")
    return str(image.id)


def _repository_of_tag(tag: str) -> str:
    name, colon, suffix = tag.rpartition(":")
    return name if colon and "/" not in suffix else tag


def discover(
    request: DiscoveryRequest,
    *,
    runner_id: str,
    client: Any | None = None,
    start_timeout: float = START_TIMEOUT_SECONDS,
    list_timeout: float = LIST_TIMEOUT_SECONDS,
    max_seconds: float = DEFAULT_MAX_CALL_SECONDS,
) -> dict[str, Any]:
    """The report's claims for ``request`` (``image``, ``server_info``, ``tools``,
    ``error``), without the envelope; failures become an error, never an exception.

    The server's start and its listing together take at most ``max_seconds`` from now (the
    runner's KESTREL_MAX_CALL_SECONDS, within which Celery lets a task run): past it the
    discovery fails with a report, where Celery's hard limit would have ended the worker
    and sent none."""
    ends = time.monotonic() + max_seconds
    own = client is None
    image: str | None = None
    try:
        if client is None:
            try:
                client = docker.from_env()
            except docker.errors.DockerException as error:
                raise McpUnavailable(f"docker: no engine answers ({error})") from None
        # A discovery a killed worker left is delivered again: what it left goes first.
        remove_orphaned_mcp_servers(runner_id, client)
        profile = dict(request.profile)
        image = resolve_image(client, profile, request.managed)
        profile["image"] = image
        server_info, tools = _list(
            client,
            profile,
            runner_id,
            request.discovery,
            min(start_timeout, max_seconds),
            list_timeout,
            ends,
        )
        return {"image": image, "server_info": server_info, "tools": tools, "error": None}
    except McpError as error:
        return {
            "image": image,
            "server_info": None,
            "tools": None,
            "error": {"code": error.code, "message": str(error)[:_MAX_MESSAGE_CHARS]},
        }
    finally:
        if own and client is not None:
            client.close()


def _list(
    client: Any,
    profile: dict[str, Any],
    runner_id: str,
    discovery: str,
    start_timeout: float,
    list_timeout: float,
    ends: float,
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    workspace = _empty_workspace() if profile["workspace"] != "none" else None

    async def listing() -> tuple[dict[str, str], list[dict[str, Any]]]:
        async with server_session(
            client,
            profile,
            labels={"runner": runner_id, "discovery": discovery, **owner_labels()},
            workspace=workspace,
            start_timeout=start_timeout,
        ) as (session, init, _container):
            info = {
                "name": str(init.server_info.name)[:256],
                "version": str(init.server_info.version or "")[:256],
            }
            left = ends - time.monotonic()
            if left <= 0:
                raise McpTimeout(
                    "the server started with no time left to list its tools within the "
                    "runner's KESTREL_MAX_CALL_SECONDS"
                )
            return info, await list_tools(session, timeout_s=min(list_timeout, left))

    try:
        info, listed = anyio.run(listing)
    finally:
        if workspace is not None:
            shutil.rmtree(workspace, ignore_errors=True)
    return info, _bounded_definitions(listed)


def _bounded_definitions(listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The definitions to report (``list_tools`` gives definitions, within MAX_LISTED_BYTES
    in all, which a report the control plane takes holds); a server whose tools exceed a
    bound of one tool is refused whole (a definition cut to fit would be another one)."""
    for definition in listed:
        name = str(definition.get("name", ""))[:128]
        description = definition.get("description")
        if isinstance(description, str) and len(description) > MAX_DESCRIPTION_CHARS:
            raise McpProtocolError(
                f"the tool {name!r} has a description over {MAX_DESCRIPTION_CHARS} characters"
            )
        for field in ("inputSchema", "outputSchema"):
            if field in definition and len(canonical_json(definition[field])) > MAX_SCHEMA_BYTES:
                raise McpProtocolError(
                    f"the tool {name!r} has an {field} over {MAX_SCHEMA_BYTES} bytes"
                )
    return listed


def _empty_workspace() -> Path:
    """An empty workspace for the listing, owned by the sandbox's user."""
    path = Path(tempfile.mkdtemp(prefix="kestrel-mcp-discovery-"))
    if os.geteuid() == 0:
        owner = workspace_owner()
        for folder, dirs, files in os.walk(path):
            os.chown(folder, *owner)
            for name in dirs + files:
                os.chown(os.path.join(folder, name), *owner)
    return path
