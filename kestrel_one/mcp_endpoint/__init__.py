"""Kestrel One as an MCP server: one governed Streamable HTTP endpoint per Project
(docs/mcp-endpoint.md)."""
