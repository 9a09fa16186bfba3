"""Fitting a call's result into the signed report's size budget (KESTREL_MAX_REPORT_BYTES).

A sandbox caps each output stream at the command's ``output_kb``, but a byte is not a byte
of report: a NUL travels as ``\\u0000`` (six bytes of JSON) and the whole payload as base64,
so 700 KB of zeros printed under a 1 MiB cap made a 5.6 MB report the control plane could
not take, and the call that ran was left without a receipt. The runner therefore measures
the report it is about to sign and, when it is over the budget, shrinks the result, keeping
as much as fits and saying what it cut:

1. Text that can be cut (``stdout``, ``stderr``, ``content`` of ``fs.read``) is cut to a
   common length, longest first (so a short stderr survives a flood on stdout). The result
   then says ``truncated: true`` and, under ``report_cut``, each cut field's full size in
   UTF-8 bytes, its SHA-256 and how many bytes were kept.
2. Declared output files (``outputs``) lose their content, largest first; each keeps its
   path, size and SHA-256 with ``error: "too_large"``.
3. A directory listing (``entries``) is shortened, with ``truncated: true``.

If the result still does not fit (a checkpoint archive larger than the budget), the report
says the call failed with ``report_too_large``: a call that ran always gets a report, and so
a receipt (docs/runners.md#reports).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from runners.contract.canonical import canonical_json

__all__ = ["REPORT_TOO_LARGE", "fit_result"]

REPORT_TOO_LARGE = "report_too_large"
_TEXT_FIELDS = ("stdout", "stderr", "content")
# Room left for the ``report_cut`` entry of one field and the flags.
_CUT_NOTE_BYTES = 200


def fit_result(
    result: dict[str, Any], size_of: Callable[[dict[str, Any]], int], budget: int
) -> dict[str, Any] | None:
    """``result`` shrunk until ``size_of(result) <= budget``, or None when it cannot be.

    ``size_of`` measures the whole signed report that would carry the result; it is called
    a few times, each time on a smaller result. An unchanged result is returned as it is.
    """
    if size_of(result) <= budget:
        return result
    fitted = dict(result)
    for shrink in (_cut_text, _drop_output_contents, _shorten_entries):
        for _ in range(8):  # each round closes most of the gap; a few always suffice
            size = size_of(fitted)
            if size <= budget:
                return fitted
            # The report is a signed encoding of the result (base64 of its JSON): the bytes
            # to cut from the JSON are the excess scaled by how the two sizes compare.
            excess = -(-(size - budget) * _json_size(fitted) // size)
            if not shrink(fitted, excess):
                break
    return fitted if size_of(fitted) <= budget else None


def _json_size(value: Any) -> int:
    return len(canonical_json(value))


def _cut_text(result: dict[str, Any], excess: int) -> bool:
    """Cut the text fields to one common JSON size that removes ``excess`` bytes."""
    sizes = {
        name: _json_size(result[name])
        for name in _TEXT_FIELDS
        if isinstance(result.get(name), str) and result[name]
    }
    if not sizes:
        return False
    target = excess + _CUT_NOTE_BYTES * len(sizes)
    cap = _water_level(sorted(sizes.values(), reverse=True), target)
    cut = result.setdefault("report_cut", {})
    changed = False
    for name, size in sizes.items():
        if size <= cap:
            continue
        text = result[name]
        if name not in cut:
            whole = text.encode("utf-8", errors="surrogatepass")
            cut[name] = {"bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}
        kept = _prefix_within(text, max(cap, 2))
        cut[name]["kept_bytes"] = len(kept.encode("utf-8", errors="surrogatepass"))
        result[name] = kept
        changed = changed or kept != text
    result["truncated"] = True
    return changed


def _water_level(sizes: list[int], remove: int) -> int:
    """The cap ``c`` such that cutting every size above ``c`` down to it removes ``remove``."""
    total = sum(sizes)
    if remove >= total:
        return 0
    # Lower the level past each size in turn until enough would be removed.
    for count in range(1, len(sizes) + 1):
        level = (sum(sizes[:count]) - remove) // count
        following = sizes[count] if count < len(sizes) else 0
        if level >= following:
            return max(level, 0)
    return 0


def _prefix_within(text: str, limit: int) -> str:
    """A prefix of ``text`` whose JSON form is at most ``limit`` bytes (close to the longest).

    Escapes make the JSON size of a character vary (1 to 6 bytes), so the cut is estimated
    from the ratio and corrected; each pass is one encode of the prefix.
    """
    cut = len(text)
    while cut > 0:
        size = _json_size(text[:cut])
        if size <= limit:
            return text[:cut]
        cut = min(cut - 1, cut * limit // size)
    return ""


def _drop_output_contents(result: dict[str, Any], excess: int) -> bool:
    outputs = result.get("outputs")
    if not isinstance(outputs, list):
        return False
    carrying = sorted(
        (index for index, entry in enumerate(outputs) if "content_b64" in entry),
        key=lambda index: len(outputs[index]["content_b64"]),
        reverse=True,
    )
    if not carrying:
        return False
    kept = list(outputs)
    freed = 0
    for index in carrying:
        entry = kept[index]
        freed += len(entry["content_b64"])
        kept[index] = {
            "path": entry["path"],
            "size": entry["size"],
            "sha256": entry["sha256"],
            "error": "too_large",
        }
        if freed >= excess:
            break
    result["outputs"] = kept
    return True


def _shorten_entries(result: dict[str, Any], excess: int) -> bool:
    entries = result.get("entries")
    if not isinstance(entries, list) or not entries:
        return False
    size = _json_size(entries)
    keep = max(0, len(entries) - (len(entries) * excess) // size - 1)
    result["entries"] = entries[:keep]
    result["truncated"] = True
    return True
