"""The tools, one module per family: each defines its ``ToolSpec``s beside their code.

``runners.contract.registry.TOOL_MODULES`` lists these modules; a module imports only the
contract and ``runners.workspace`` (never ``runners.sandbox``), so the control plane can
read every spec without loading the sandbox backends. ``runners.dispatch`` runs them.
"""
