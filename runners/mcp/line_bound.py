"""Between an MCP server's stdout and the SDK's reader: every line at most ``--max-line``
bytes, and all of it UTF-8, or the session ends.

The SDK's stdio client keeps a server's unfinished line in memory until its newline comes,
however long it grows, and copies it again with every chunk. A server that writes without
end and never a newline would take the runner host's memory and CPU. Its reader decodes
stdout as strict UTF-8 and dies at a byte that is not, but only once the server closes its
stdout: until then the session waits, and a call with it, for its whole timeout. Run as
``python -I line_bound.py --max-line N --reason FILE -- docker start --attach --interactive
ID``: the command gets this process's stdin directly, its stdout passes through here
unchanged, and a line past the bound or bytes that are not UTF-8 close this process's
stdout (the session sees its end at once), write why to FILE (a file of the runner's, which
the session reads to say why it ended) and to stderr (the session's stderr tail), then stop
the command and end this process. The chunk at fault is never passed on.

Only the standard library, run with ``-I``: nothing on the runner's path changes it.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import os
import signal
import subprocess
import sys

_CHUNK = 64 * 1024


def copy_bounded(source: int, sink: int, max_line: int) -> str | None:
    """Copy ``source`` to ``sink`` until end of file (None), or until a line passes
    ``max_line`` bytes or a byte is not UTF-8 (why, in words; the chunk holding it is not
    copied). A character may span chunks: the decoder keeps its start until the rest."""
    line = 0  # bytes of the unfinished line so far
    decoder = codecs.getincrementaldecoder("utf-8")()
    while chunk := os.read(source, _CHUNK):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if line + end - start > max_line:
                return f"the MCP server wrote a line longer than {max_line} bytes"
            line, start = 0, end + 1
        line += len(chunk) - start
        if line > max_line:
            return f"the MCP server wrote a line longer than {max_line} bytes"
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError:
            return "the MCP server wrote bytes that are not UTF-8 on its stdout"
        view = memoryview(chunk)
        while view:
            view = view[os.write(sink, view) :]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-line", type=int, required=True, help="bytes per line, at most")
    parser.add_argument("--reason", help="a file to write why the session ended into")
    parser.add_argument("command", nargs="+", help="the command whose stdout is passed on")
    options = parser.parse_args(argv)
    child = subprocess.Popen(options.command, stdout=subprocess.PIPE)
    assert child.stdout is not None
    reason = copy_bounded(child.stdout.fileno(), sys.stdout.fileno(), options.max_line)
    if reason is None:
        return child.wait()
    if options.reason:
        with contextlib.suppress(OSError), open(options.reason, "w") as told:
            told.write(reason)
    # The session ends now, not when the command does (a server may ignore the signal).
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.stderr.write(f"kestrel: {reason}; its session is ended\n")
    sys.stderr.flush()
    child.send_signal(signal.SIGTERM)
    child.wait()
    return 1


if __name__ == "__main__":
    sys.exit(main())
