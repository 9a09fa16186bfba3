"""Known prompt-injection patterns, flagged at input boundaries.

A flag is information for the person who reviews an action. It never grants or removes
authority: policy decides the same way for flagged and unflagged content (SPEC API-6, POL-5).
These patterns lower risk; they cannot prove arbitrary content harmless.
"""

from __future__ import annotations

import re
from typing import Any

MAX_SCANNED_CHARS = 256 * 1024

PATTERNS: dict[str, re.Pattern[str]] = {
    "ignore_instructions": re.compile(
        r"\b(ignore|disregard|forget)\b[^.\n]{0,40}\b(previous|prior|above|earlier|all)\b"
        r"[^.\n]{0,20}\b(instructions?|prompts?|rules|messages?)",
        re.IGNORECASE,
    ),
    "role_override": re.compile(
        r"\b(you are now|act as|pretend (to be|you are)|from now on you)\b", re.IGNORECASE
    ),
    "system_prompt": re.compile(
        r"(\bsystem prompt\b|<\|im_start\|>|<\|system\|>|\[/?INST\]|BEGIN SYSTEM|###\s*system)",
        re.IGNORECASE,
    ),
    "claims_approval": re.compile(
        r"(\b(this|the) (action|request|call|command) (is|was|has been) (pre-?)?approved\b"
        r"|\"?approv(ed|al)\"?\s*[:=]\s*\"?(true|yes|granted)"
        r"|\b(admin|owner|user) (has )?(approved|authori[sz]ed)\b)",
        re.IGNORECASE,
    ),
    "grants_permission": re.compile(
        r"\b(grant|give|enable)\b[^.\n]{0,30}\b(permission|capabilit(y|ies)|access|sudo|root)\b",
        re.IGNORECASE,
    ),
    "exfiltration": re.compile(
        r"\b(send|post|upload|exfiltrate|leak)\b[^.\n]{0,40}\b(secrets?|credentials?|tokens?|"
        r"api[ _-]?keys?|passwords?|env(ironment)? variables)\b",
        re.IGNORECASE,
    ),
}


def injection_flags(value: Any) -> list[str]:
    """The names of the patterns found anywhere in the strings of ``value`` (sorted)."""
    found: set[str] = set()
    budget = [MAX_SCANNED_CHARS]

    def scan(item: Any) -> None:
        if budget[0] <= 0:
            return
        if isinstance(item, str):
            text = item[: budget[0]]
            budget[0] -= len(text)
            found.update(name for name, pattern in PATTERNS.items() if pattern.search(text))
        elif isinstance(item, dict):
            for key, sub in item.items():
                scan(key)
                scan(sub)
        elif isinstance(item, list | tuple):
            for sub in item:
                scan(sub)

    scan(value)
    return sorted(found)
