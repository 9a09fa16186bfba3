"""The wire contract between the control plane and runners, shared by both tiers.

What travels between them and what both must agree on: signed tokens (``tokens``), the
canonical form and digest (``canonical``), the tools and their argument rules
(``registry``, ``arguments``), error codes (``errors``), path rules (``paths``), task,
queue, audience and issuer names (``names``) and broker addresses (``broker``). It imports
neither Django nor ``kestrel_one`` nor the runner's machinery (``runners.sandbox``,
``runners.worker``, the Docker SDK); import-linter holds it to that (pyproject.toml).
"""
