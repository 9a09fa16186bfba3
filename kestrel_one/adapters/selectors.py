"""Reading the adapter registry for people and integrations (API and console)."""

from __future__ import annotations

from typing import Any

from kestrel_one.adapters.registry import ADAPTERS


def adapters_describe() -> list[dict[str, Any]]:
    """Every registered adapter and operation: the exact resource, effect, credential kind and
    how the credential is presented (never a credential), argument schema and bounds."""
    return [
        {
            "name": adapter.name,
            "summary": adapter.summary,
            "credential_kind": adapter.credential_kind,
            # Called by the model gateway (model.invoke) only, never by adapter.invoke.
            "model_provider": adapter.model_provider,
            "presentation": {
                "header": adapter.presentation.header,
                "form": adapter.presentation.form,
            },
            "operations": [
                {
                    "name": operation.name,
                    "summary": operation.summary,
                    "method": operation.method,
                    "host": operation.host,
                    "port": operation.port,
                    "path": operation.path,
                    "resource": operation.resource(),
                    "effect": operation.effect.value,
                    "input_schema": operation.input_schema(),
                    "response_max_bytes": operation.response_max_bytes,
                    "timeout_s": operation.timeout_s,
                    "idempotency_header": operation.idempotency_header,
                    "streams": operation.streams,
                    # An external operation: approval always, idempotency key required.
                    "requires_approval": operation.effect.value == "external",
                    "requires_idempotency_key": operation.effect.value == "external",
                }
                for operation in sorted(adapter.operations.values(), key=lambda o: o.name)
            ],
        }
        for adapter in sorted(ADAPTERS.values(), key=lambda a: a.name)
    ]
