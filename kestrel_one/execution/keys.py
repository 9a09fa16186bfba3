"""The control plane's command-signing key (kept in kestrel_one.common.keys, which the audit
app's signed heads use too)."""

from __future__ import annotations

from kestrel_one.common.keys import control_private_key, control_public_key_pem

__all__ = ["control_private_key", "control_public_key_pem"]
