"""The sessions of the MCP endpoint.

The endpoint keeps no state in a web process (any worker answers any request), so a
session of the 2025-11-25 wire is a row: the ``Mcp-Session-Id`` a client echoes names it,
and it holds the thread its calls run in, so the sandboxes of one session stay warm.
"""

from __future__ import annotations

from django.db import models

from kestrel_one.common.ids import PublicIdField


class McpSession(models.Model):
    public_id = PublicIdField("mcs")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="mcp_sessions"
    )
    project = models.ForeignKey(
        "tenancy.Project", on_delete=models.CASCADE, related_name="mcp_sessions"
    )
    # Who opened it (Principal.actor_id), and which agent that is (Principal.agent_id): only
    # the same agent may use it (the token, one it minted, an OAuth client's refreshed one).
    actor_id = models.CharField(max_length=64)
    agent_id = models.CharField(max_length=64, blank=True, default="")
    # Whose authority that caller holds (Principal.holder_id): what the bound on open
    # sessions counts (KESTREL_MCP_SESSIONS_PER_CALLER).
    holder_id = models.CharField(max_length=64, blank=True, default="")
    mode = models.CharField(max_length=8)
    # Made at the session's first tools/call, unless the client named one (?thread=).
    thread = models.ForeignKey(
        "threads.Thread", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    client_name = models.CharField(max_length=200, blank=True, default="")
    protocol_version = models.CharField(max_length=32, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["organization", "public_id"]),
            models.Index(fields=["organization", "holder_id", "last_seen_at"]),
        ]

    def __str__(self) -> str:
        return self.public_id
