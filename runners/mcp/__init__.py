"""MCP servers on the runner: hardened server containers from signed profiles, stdio
sessions with the MCP Python SDK, warm per thread through relays, and discovery.

docs/runners.md ("MCP servers") has the design; ``runners.contract.mcp`` the wire contract.
"""
