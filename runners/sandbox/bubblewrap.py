"""The bubblewrap backend: single-host confinement when there is no Docker engine.

The command sees a new root built from the host's system directories mounted read-only
(``/usr``, the ``/bin``-style links and the few ``/etc`` entries programs read: the dynamic
linker's cache, ``alternatives``, time zone, CA certificates...), its workspace read-write at
``/workspace``, a private size-bounded tmpfs at ``/tmp``, fresh ``/dev`` and ``/proc``, and
no other host path: not other projects' workspaces, not the runner's files, not the
Docker socket. Every namespace is new (user, PID, network with only ``lo``, IPC, UTS,
cgroup), capabilities are dropped and no-new-privileges is set by bwrap itself.

What bwrap cannot do is cgroup accounting: memory, CPU and process counts are bounded with
rlimits (``prlimit``) instead, which is best effort. RLIMIT_DATA caps each process's
memory, not the tree's; CPU shares are not enforced, only total CPU seconds. An
out-of-memory kill cannot be told from other deaths, so ``oom_killed`` is always false
here. Use Docker where those matter.

The process limit is the sandbox's own, although every sandbox runs as the same uid: the
kernel counts RLIMIT_NPROC per user namespace and uid (Linux 5.14 and later), and checks a
namespace's count against the limit only inside that namespace; its parents are checked
against the limit its creator had. So the limit is set inside the sandbox (``prlimit
--nproc`` exec'ing the command, as PID 1 of the new namespaces), never on bwrap: set there,
it would apply to the uid's count on the host, shared by every tenant's sandboxes, and one
sandbox at its limit would keep the others from even starting.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import time

from runners.sandbox.base import (
    SANDBOX_ADAPTER_DIR,
    SANDBOX_TMP,
    SANDBOX_WORKSPACE,
    ExecResult,
    ExecSpec,
    OutputBuffer,
    SandboxBackend,
    SandboxStartFailed,
    SandboxUnavailable,
)
from runners.workspace import workspace_owner

# System directories a program needs; the /bin-style names are links on merged-/usr hosts.
_SYSTEM_DIRECTORIES = ("/usr",)
# What of the host's /etc a program reads, and nothing else: /etc also holds what a host
# keeps for itself, world-readable or readable by the uid the sandbox may share with the
# runner (its key under /etc/kestrel, a registry token in /etc/npmrc or /etc/pip.conf, git's
# credentials in /etc/gitconfig, the host's accounts in /etc/passwd). Names that do not
# exist on this host are left out; glob patterns are allowed.
_SYSTEM_ETC = (
    "alternatives",
    "ca-certificates.conf",
    "debian_version",
    "gai.conf",
    "host.conf",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "localtime",
    "magic",
    "magic.mime",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "perl",
    "protocols",
    "python3*",
    "services",
    "ssl/certs",
    "ssl/openssl.cnf",
    "terminfo",
    "timezone",
)
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
# The first kernel to count RLIMIT_NPROC per user namespace (see the module's docstring).
_PER_NAMESPACE_NPROC = (5, 14)
_KILL_GRACE_S = 10
_READ_CHUNK = 64 * 1024


class BubblewrapBackend(SandboxBackend):
    """Runs commands under ``bwrap`` as the unprivileged sandbox user."""

    name = "bubblewrap"

    def __init__(self, *, bwrap: str = "bwrap", prlimit: str = "prlimit") -> None:
        self.bwrap = bwrap
        self.prlimit = prlimit

    @classmethod
    def from_environment(cls) -> BubblewrapBackend:
        """The backend for this host, if ``bwrap`` and ``prlimit`` are installed."""
        bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
        if bwrap is None:
            raise SandboxUnavailable(
                "bubblewrap: bwrap is not installed (apt-get install bubblewrap)"
            )
        if prlimit is None:
            raise SandboxUnavailable("bubblewrap: prlimit is not installed (util-linux)")
        prlimit = os.path.realpath(prlimit)
        if not prlimit.startswith(tuple(f"{name}/" for name in _SYSTEM_DIRECTORIES)):
            # It runs inside the sandbox too, which sees only the system directories.
            raise SandboxUnavailable(f"bubblewrap: prlimit must be under /usr, not {prlimit}")
        release = kernel_release()
        if release < _PER_NAMESPACE_NPROC:
            raise SandboxUnavailable(
                f"bubblewrap: Linux {release[0]}.{release[1]} counts processes per uid across "
                "the host, so sandboxes would share one process limit; it needs Linux 5.14 "
                "or later"
            )
        return cls(bwrap=bwrap, prlimit=prlimit)

    def command_line(self, spec: ExecSpec, status_fd: int) -> list[str]:
        """The full ``prlimit ... bwrap ... -- argv`` line that confines ``spec``."""
        limits = spec.limits
        # RLIMIT_CPU is whole seconds of CPU time; the wall clock is enforced separately.
        cpu_seconds = math.ceil(limits.timeout_s * limits.cpus) + 1
        line = [
            self.prlimit,
            f"--data={limits.memory_mb * 1024 * 1024}",
            f"--cpu={cpu_seconds}",
            "--core=0",
            "--",
            self.bwrap,
            "--unshare-all",
            # A user namespace of its own, and no further ones: nested namespaces would
            # hand the command capabilities (mount, ...) over its own little world.
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            # The command itself is PID 1 of its namespace, a direct child of bwrap. With
            # bwrap's own init in between, that init would outlive bwrap as a zombie until
            # the host's init reaps it. When the command ends, the kernel ends the
            # namespace's other processes.
            "--as-pid-1",
            "--cap-drop",
            "ALL",
        ]
        for directory in _SYSTEM_DIRECTORIES:
            line += ["--ro-bind", directory, directory]
        line += ["--dir", "/etc"]
        for name in (*_SYSTEM_LINKS, *system_etc_entries()):
            if os.path.islink(name):
                line += ["--symlink", os.readlink(name), name]
            elif os.path.exists(name):
                line += ["--ro-bind", name, name]
        line += [
            "--dev", "/dev",
            "--proc", "/proc",
            "--dir", SANDBOX_WORKSPACE,
            "--bind", str(spec.workspace.resolve(strict=True)), SANDBOX_WORKSPACE,
            "--size", str(limits.tmp_mb * 1024 * 1024), "--tmpfs", SANDBOX_TMP,
        ]  # fmt: skip
        if spec.adapter_dir is not None:
            # The call's adapter broker socket, read-only (runners.adapter_broker); the network
            # namespace stays empty but for lo.
            line += ["--ro-bind", str(spec.adapter_dir), SANDBOX_ADAPTER_DIR]
        line += [
            # The new root is a tmpfs that bwrap filled in; freeze it so nothing but the
            # workspace and /tmp is writable.
            "--remount-ro", "/",
            "--chdir", spec.sandbox_cwd,
            "--clearenv",
        ]  # fmt: skip
        for name, value in spec.environment().items():
            line += ["--setenv", name, value]
        # The process limit, set inside the sandbox's own user namespace (see the module's
        # docstring); prlimit then execs the command, which stays PID 1.
        line += ["--json-status-fd", str(status_fd), "--"]
        line += [self.prlimit, f"--nproc={limits.pids}", "--", *spec.argv]
        return line

    def run(self, spec: ExecSpec) -> ExecResult:
        limit = spec.limits.output_kb * 1024
        stdout, stderr = OutputBuffer(limit), OutputBuffer(limit)
        status_read, status_write = os.pipe()
        try:
            process = self._start(spec, status_write)
        finally:
            os.close(status_write)
        started = time.monotonic()
        collector = _Collector(process, status_read, stdout, stderr)
        timed_out = not collector.collect(spec.limits.timeout_s)
        if timed_out:
            # bwrap's own process group. The command, PID 1 of its namespace, gets SIGKILL
            # when bwrap dies (--die-with-parent) and takes the whole namespace with it,
            # background children included.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            collector.collect(_KILL_GRACE_S)
        returncode = process.wait(_KILL_GRACE_S)
        duration_ms = int((time.monotonic() - started) * 1000)
        for stream in (process.stdout, process.stderr):
            stream.close()
        os.close(status_read)
        if not timed_out and not _child_started(collector.status):
            raise SandboxStartFailed(
                f"bubblewrap: the sandbox did not start: {stderr.text().strip()}"
            )
        return ExecResult(
            exit_code=returncode if returncode >= 0 else 128 - returncode,
            stdout=stdout.text(),
            stderr=stderr.text(),
            truncated=stdout.truncated or stderr.truncated,
            duration_ms=duration_ms,
            timed_out=timed_out,
            oom_killed=False,
            sandbox=self.name,
        )

    def _start(self, spec: ExecSpec, status_fd: int) -> subprocess.Popen[bytes]:
        uid, gid = workspace_owner()
        drop_to_sandbox_user = {}
        if os.geteuid() == 0:
            # Never give bwrap root: unprivileged, it builds its sandbox in a user namespace
            # where the sandbox user maps to itself, not to the host's root.
            drop_to_sandbox_user = {"user": uid, "group": gid, "extra_groups": []}
        try:
            return subprocess.Popen(
                self.command_line(spec, status_fd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_fd,),
                process_group=0,
                close_fds=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                cwd="/",
                **drop_to_sandbox_user,
            )
        except OSError as error:
            raise SandboxStartFailed(f"bubblewrap: cannot start bwrap: {error}") from None


class _Collector:
    """Reads a running sandbox's stdout, stderr and bwrap status pipe, across several waits."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        status_fd: int,
        stdout: OutputBuffer,
        stderr: OutputBuffer,
    ) -> None:
        self.status = bytearray()
        self._sinks = {
            process.stdout.fileno(): stdout.feed,
            process.stderr.fileno(): stderr.feed,
            status_fd: self.status.extend,
        }
        self._open = set(self._sinks)

    def collect(self, timeout_s: float) -> bool:
        """Read until every stream has ended (True) or ``timeout_s`` has passed (False)."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            for fd in self._open:
                selector.register(fd, selectors.EVENT_READ)
            while self._open:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                for key, _ in selector.select(remaining):
                    chunk = os.read(key.fd, _READ_CHUNK)
                    if chunk:
                        self._sinks[key.fd](chunk)
                    else:
                        selector.unregister(key.fd)
                        self._open.discard(key.fd)
        return True


def system_etc_entries() -> list[str]:
    """The host's ``/etc`` entries a sandbox sees (``_SYSTEM_ETC``), those this host has."""
    return sorted({path for name in _SYSTEM_ETC for path in glob.glob(f"/etc/{name}")})


def kernel_release() -> tuple[int, int]:
    """The running kernel's (major, minor) version; (0, 0) if it cannot be read."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def _child_started(status: bytes) -> bool:
    """Whether bwrap reported spawning the command (its first JSON status document)."""
    decoder = json.JSONDecoder()
    text = status.decode("utf-8", errors="replace").lstrip()
    while text:
        document, end = decoder.raw_decode(text)
        if "child-pid" in document:
            return True
        text = text[end:].lstrip()
    return False
