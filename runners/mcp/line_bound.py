"""Between an MCP server's stdout and the SDK's reader: every line at most ``--max-line``
bytes, or the session ends.

The SDK's stdio client keeps a server's unfinished line in memory until its newline comes,
however long it grows, and copies it again with every chunk. A server that writes without
end and never a newline would take the runner host's memory and CPU. Run as
``python -I line_bound.py --max-line N -- docker start --attach --interactive ID``: the command
gets this process's stdin directly, its stdout passes through here unchanged, and a line
past the bound stops the command and ends this process with a message on stderr (the
session's stderr tail), so the session fails at once instead of waiting for a line.

Only the standard library, run with ``-I``: nothing on the runner's path changes it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

_CHUNK = 64 * 1024


def copy_bounded(source: int, sink: int, max_line: int) -> bool:
    """Copy ``source`` to ``sink`` until end of file (True), or until a line passes
    ``max_line`` bytes (False; the chunk holding its excess is not copied)."""
    line = 0  # bytes of the unfinished line so far
    while chunk := os.read(source, _CHUNK):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if line + end - start > max_line:
                return False
            line, start = 0, end + 1
        line += len(chunk) - start
        if line > max_line:
            return False
        view = memoryview(chunk)
        while view:
            view = view[os.write(sink, view) :]
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-line", type=int, required=True, help="bytes per line, at most")
    parser.add_argument("command", nargs="+", help="the command whose stdout is passed on")
    options = parser.parse_args(argv)
    child = subprocess.Popen(options.command, stdout=subprocess.PIPE)
    assert child.stdout is not None
    if copy_bounded(child.stdout.fileno(), sys.stdout.fileno(), options.max_line):
        return child.wait()
    sys.stderr.write(
        f"kestrel: the MCP server wrote a line longer than {options.max_line} bytes; "
        "its session is ended\n"
    )
    sys.stderr.flush()
    child.send_signal(signal.SIGTERM)
    child.wait()
    return 1


if __name__ == "__main__":
    sys.exit(main())
