"""Caps on the size of a policy document: its bytes, and the length of every list it holds.

Every question the engine answers costs time that grows with the patterns and names it is
asked about, and documents come from tenants; without a cap one organization's document
could hold a web worker for as long as it liked. The caller (the control plane, from its
settings) passes the caps in; the defaults here are generous for any real policy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DocumentLimits:
    """The most a document may hold; each field caps one kind of list, per list."""

    # The JSON text, in UTF-8 bytes.
    bytes: int = 64 * 1024
    # fs.read / fs.write ``paths``.
    paths: int = 256
    # net.http ``allow``.
    origins: int = 64
    # shell.exec ``commands``.
    commands: int = 128
    # shell.exec ``env``.
    env: int = 64
    # model.invoke ``models``.
    models: int = 64
    # mcp.call ``servers``.
    servers: int = 32
    # mcp.call ``tools`` and ``dangerous``, per server.
    tools: int = 256
    # adapter.invoke ``adapters``.
    adapters: int = 32
    # adapter.invoke ``operations``, per adapter.
    operations: int = 128

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"document limit {spec.name} must be a positive whole number")


LIMIT_FIELDS: tuple[str, ...] = tuple(spec.name for spec in fields(DocumentLimits))
DEFAULT_DOCUMENT_LIMITS = DocumentLimits()
