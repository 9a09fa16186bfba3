"""Known prompt-injection patterns, flagged at input boundaries.

A flag is information for the person who reviews an action. It never grants or removes
authority: policy decides the same way for flagged and unflagged content (SPEC API-6, POL-5).
These patterns lower risk; they cannot prove arbitrary content harmless.

Hidden characters are a pattern of their own (``hidden_characters``): text a person reads
in a page is not all the text a model reads. Bidirectional controls reorder what is shown,
zero-width and other format characters split a phrase so that no pattern matches it, and
Unicode tag characters (U+E0000 to U+E007F) or variation selectors carry a whole
instruction that a browser draws as nothing while a model decodes it. So each string is
also scanned as a model may read it (tags as the ASCII they mirror, the rest of the hidden
characters dropped), and ``hidden_revealed`` shows each hidden character as ``[U+XXXX]``
where a person reviews untrusted text.
"""

from __future__ import annotations

import re
import unicodedata
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


HIDDEN_CHARACTERS = "hidden_characters"
# Drawn as nothing, or not as themselves, whatever the font: format characters (bidi
# controls, zero-width characters, tags, the byte order mark, the soft hyphen), control
# characters other than tab and line breaks, private-use, surrogate and unassigned code
# points, line and paragraph separators.
_HIDDEN_CATEGORIES = frozenset({"Cf", "Cc", "Co", "Cs", "Cn", "Zl", "Zp"})
_SHOWN_CONTROLS = frozenset("\t\n\r")
# Invisible although their category says otherwise: variation selectors (which can encode a
# byte each after any character), the combining grapheme joiner and the Hangul fillers.
_HIDDEN_RANGES = ((0xFE00, 0xFE0F), (0xE0100, 0xE01EF), (0x034F, 0x034F), (0x115F, 0x1160))
_HIDDEN_POINTS = frozenset({0x3164, 0xFFA0})
_TAGS = range(0xE0000, 0xE0080)


def is_hidden(char: str) -> bool:
    """Whether a person reading ``char`` in a page cannot see it (or what it does)."""
    if char in _SHOWN_CONTROLS:
        return False
    point = ord(char)
    if point < 0x7F and char.isprintable():
        return False
    return (
        unicodedata.category(char) in _HIDDEN_CATEGORIES
        or point in _HIDDEN_POINTS
        or any(low <= point <= high for low, high in _HIDDEN_RANGES)
    )


def _has_hidden(text: str) -> bool:
    return not (text.isascii() and text.isprintable()) and any(is_hidden(c) for c in text)


# What joins an emoji to the next or picks its presentation (U+200D, U+FE0E, U+FE0F): hidden, and
# shown as [U+XXXX] where a person reviews a server's text, but after a character that is no
# ASCII it is how emoji are written, not a sign of hiding, so it alone raises no flag. The
# text it could split is still matched without it.
_EMOJI_GLUE = frozenset("\u200d\ufe0e\ufe0f")


def _hides(text: str) -> bool:
    """Whether ``text``, which holds a hidden character (``_has_hidden``), holds one worth a
    flag."""
    return any(
        is_hidden(char) and not (char in _EMOJI_GLUE and at > 0 and not text[at - 1].isascii())
        for at, char in enumerate(text)
    )


def _as_a_model_reads(text: str) -> str:
    """``text`` with each tag character as the ASCII it mirrors and every other hidden
    character dropped: the phrase a person cannot see, which the patterns then match."""
    return "".join(
        chr(ord(char) - 0xE0000) if ord(char) in _TAGS else "" if is_hidden(char) else char
        for char in text
    )


def hidden_revealed(text: str) -> str:
    """``text`` for a person to review: each hidden character as ``[U+XXXX]``."""
    if not _has_hidden(text):
        return text
    return "".join(f"[U+{ord(char):04X}]" if is_hidden(char) else char for char in text)


def injection_flags(value: Any, *, max_chars: int = MAX_SCANNED_CHARS) -> list[str]:
    """The names of the patterns found in the strings of ``value`` (sorted), keys and values
    in order, up to ``max_chars`` characters in all, and ``hidden_characters`` where one holds
    a character a person cannot see: a caller whose input can be larger (a runner's report)
    passes its own bound, or what comes after the budget is unflagged."""
    found: set[str] = set()
    budget = [max_chars]

    def scan(item: Any) -> None:
        if budget[0] <= 0:
            return
        if isinstance(item, str):
            text = item[: budget[0]]
            budget[0] -= len(text)
            if _has_hidden(text):
                if _hides(text):
                    found.add(HIDDEN_CHARACTERS)
                text = _as_a_model_reads(text)
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
