"""Helpers for tests that start real processes: ports, and stopping what they started."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen, *, timeout: float = 30) -> None:
    """Ask a process to stop (SIGTERM), and kill it if it does not within ``timeout``."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
