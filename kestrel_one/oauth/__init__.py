"""OAuth 2.1 for MCP clients (docs/mcp-endpoint.md, "OAuth"): metadata, registration, consent,
and a token endpoint that hands out ordinary Kestrel API tokens."""
