"""What passes between an MCP server's stdout and the SDK's reader (runners/mcp/line_bound.py):
lines within the bound, and UTF-8 only; the chunk at fault never reaches the session."""

from __future__ import annotations

from pathlib import Path

from runners.mcp.line_bound import _CHUNK, copy_bounded


def _copied(tmp_path: Path, data: bytes, *, max_line: int = 1 << 20) -> tuple[str | None, bytes]:
    source, sink = tmp_path / "stdout", tmp_path / "passed"
    source.write_bytes(data)
    with source.open("rb") as reading, sink.open("wb") as writing:
        reason = copy_bounded(reading.fileno(), writing.fileno(), max_line)
    return reason, sink.read_bytes()


def test_utf_8_passes_unchanged_even_a_character_split_between_two_reads(tmp_path: Path) -> None:
    # A file is read a whole chunk at a time: the smiley's four bytes span two reads.
    data = b"a" * (_CHUNK - 2) + "\U0001f600\n".encode() + '{"text": "é"}\n'.encode()
    assert _copied(tmp_path, data) == (None, data)


def test_bytes_that_are_not_utf_8_end_the_copy_and_are_not_passed_on(tmp_path: Path) -> None:
    """The SDK decodes stdout as strict UTF-8 and its reader died at such a byte only once
    the server closed its stdout; until then the session, and the call, waited for the
    call's whole timeout. The copy stops there, saying why, with nothing of that chunk."""
    first = b'{"jsonrpc": "2.0"}\n' + b"x" * (_CHUNK - 19)
    for bad in (b"\xff", b"\xed\xa0\x80", b"\xc0\xaf"):  # no UTF-8: a lone surrogate, overlong
        reason, passed = _copied(tmp_path, first + b'{"text": "' + bad + b'"}\n')
        assert reason == "the MCP server wrote bytes that are not UTF-8 on its stdout"
        assert passed == first


def test_a_line_past_the_bound_ends_the_copy_as_before(tmp_path: Path) -> None:
    reason, passed = _copied(tmp_path, b"ok\n" + b"y" * 100, max_line=50)
    assert reason == "the MCP server wrote a line longer than 50 bytes"
    assert passed == b""
