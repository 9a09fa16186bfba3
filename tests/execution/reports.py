"""A runner's signed report on an fs.write action, as the execution tests make them."""

from __future__ import annotations

from runners.contract.tokens import sign_result


def report(action, runner, key, **claims) -> str:
    """A finished, succeeded report of ``action`` by ``runner``; ``claims`` override."""
    body = {
        "call_id": action.public_id,
        "command_digest": action.command_digest,
        "attempt": 1,
        "event": "finished",
        "outcome": "succeeded",
        "result": {"path": "src/main.py", "size": 12, "sha256": "0" * 64},
        "error": None,
        "sandbox": None,
        "started_at": "2026-11-29T12:00:00Z",
        "finished_at": "2026-11-29T12:00:01Z",
    }
    body.update(claims)
    return sign_result(body, key, runner.public_id)
