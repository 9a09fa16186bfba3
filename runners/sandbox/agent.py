"""PID 1 of a warm container: runs the thread's commands, one at a time, for the runner.

This file is not imported by the runner. Its source is handed to the container as
``python3 -I -S -c <source> <socket path>``, so it must use the standard library only and
run on the tool image's Python. It replaces ``docker exec``, which costs the engine more CPU
than the rest of a warm call (docs/performance.md). Why that keeps a call as confined as an
exec, and the runner's side of it, is in ``runners.sandbox.warm``.

Protocol, over the Unix socket the runner reaches through a per-container bind mount: one
connection per command. Every message is a 4-byte big-endian length and a JSON document.
The runner sends the request::

    {"key": "...", "probe": {"token": "...", "marker": ".kestrel-probe-...",
                             "workspace": "/workspace", "parent": [st_dev, st_ino]},
     "argv": [...], "env": {...}, "cwd": "/workspace",
     "tmpdir": "/tmp/kestrel-...", "timeout_s": 30.0, "output_limit": 65536}

The agent first probes (RUN-5, before every command), with the commands' own uid, mounts
and namespaces, against what the runner saw on the host just before: the file ``marker``
the runner wrote in the workspace must hold ``token`` and the agent must be able to remove
it (so ``/workspace`` is the workspace as the host sees it now, and writable); creating
``marker`` beside the workspace must fail; the root filesystem must be mounted
read-only; and the workspace's parent must not be ``parent`` (the host's directory of
workspaces, by device and inode). If any of that fails the agent answers
``{"probe_failed": {"workspace": [...], "beside": [...]}}`` and runs nothing; a request
without ``argv`` (the probe of a new container) is answered ``{"probe_passed": true}``.
Otherwise, after the command, the agent sends one answer: ``exit_code``,
``stdout``/``stderr`` (base64, at most ``output_limit`` bytes each), ``truncated``,
``timed_out``, ``oom_kills`` (how many processes the memory cgroup killed during the
call) and ``duration_ms``; or ``{"error": "..."}`` when the command could not be started
at all. One request, one answer: the probe adds no exchange.

What the agent guarantees:
- It answers only the runner. The peer must be outside the container (the runner's process
  is not in the container's PID namespace, so the kernel reports its pid as 0), and the
  request must carry the key the runner put in PID 1's environment (``KESTREL_AGENT_KEY``,
  dropped from the agent's environment at once and never passed to a command). A command
  inside that reaches the socket is refused before anything runs.
- It cannot be traced or read by the commands: it makes itself non-dumpable, and commands
  have no capabilities. Signals from inside its PID namespace cannot stop PID 1.
- Every command gets a fresh TMPDIR (mode 0700), exactly the environment it was sent (never
  the agent's own), no stdin and no descriptor of the agent's.
- Nothing outlives its call: when the command exits, times out, or the runner's connection
  drops, the agent sends SIGKILL to every other process in the container (``kill(-1)``),
  reaps them, empties /tmp, /dev/shm and /dev/mqueue, and removes every SysV shared memory
  segment, message queue and semaphore set of the container's IPC namespace. The
  commands run as the agent's uid, so it may remove whatever they made. This happens
  after the answer is sent and before the next connection is taken; if anything is left
  (or cannot be listed), the next request's probe fails (``probe_failed`` with ``left``),
  nothing runs, and the runner drops the container.
"""

import base64
import ctypes
import hmac
import json
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
KEY_VARIABLE = "KESTREL_AGENT_KEY"
HEADER = struct.Struct(">I")
MAX_REQUEST = 1 << 20
# cgroup v2, then v1: where a container reads how many of its processes the OOM killer took.
OOM_COUNTERS = (
    "/sys/fs/cgroup/memory.events",
    "/sys/fs/cgroup/memory/memory.oom_control",
)
SCRATCH = ("/tmp", "/dev/shm", "/dev/mqueue")  # noqa: S108 - the container's own
# SysV IPC objects of the container's IPC namespace, and how each kind is removed.
SYSV_IPC = ("shm", "msg", "sem")
IPC_RMID = 0
PROBE_MARKER = re.compile(r"\.kestrel-probe-[0-9a-f]{32}")
LIBC = ctypes.CDLL(None, use_errno=True)


def main(path):
    LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    # Python's own SIGINT handler would let a command stop PID 1. With default dispositions
    # the kernel drops every signal sent to PID 1 from inside its namespace, and a command
    # starts with default dispositions too (an ignored signal would stay ignored across exec).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    key = os.environ.pop(KEY_VARIABLE).encode()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".new")
    server.listen(4)
    os.rename(path + ".new", path)  # the runner waits for this name: it appears listening
    left = []  # what an earlier call left that could not be removed: nothing runs any more
    while True:
        connection, _ = server.accept()
        with connection:
            if peer_pid(connection) != 0:
                continue  # a process of this container; see the docstring
            try:
                request = receive(connection)
            except (OSError, ValueError):
                continue
            if not hmac.compare_digest(str(request.get("key", "")).encode(), key):
                continue
            try:
                failed = probe(request["probe"])
            except (ValueError, KeyError, TypeError):
                failed = {"workspace": ["the request has no probe"], "beside": []}
            if left:
                failed = dict(failed or {"workspace": [], "beside": []}, left=left)
            if failed:
                answer = {"probe_failed": failed}
            elif "argv" not in request:
                answer = {"probe_passed": True}
            else:
                answer = run(request, connection)
            try:
                send(connection, answer)
            except OSError:
                pass
            if "exit_code" in answer:
                # After the answer, so the runner need not wait; before the next request.
                left = clean_up()


def peer_pid(connection):
    ucred = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", ucred)[0]


def receive(connection):
    size = HEADER.unpack(read_exactly(connection, HEADER.size))[0]
    if size > MAX_REQUEST:
        raise ValueError("request too large")
    return json.loads(read_exactly(connection, size))


def read_exactly(connection, size):
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ValueError("connection closed")
        data += chunk
    return data


def send(connection, answer):
    body = json.dumps(answer).encode()
    connection.sendall(HEADER.pack(len(body)) + body)


def probe(site):
    """RUN-5 before the command (see the module's docstring): what failed, if anything, in
    the workspace and beside it.

    The agent has the commands' uid, mounts and namespaces, so what it can write a command
    can, and what it cannot, a command cannot either.
    """
    token, marker, workspace = str(site["token"]), str(site["marker"]), str(site["workspace"])
    host_parent = [int(value) for value in site["parent"]]
    if not PROBE_MARKER.fullmatch(marker) or not workspace.startswith("/"):
        raise ValueError("not a probe")
    failed = {"workspace": [], "beside": []}
    planted = os.path.join(workspace, marker)
    try:
        fd = os.open(planted, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as seen:
            if seen.read(64) != token.encode():
                failed["workspace"].append("it is not the runner's")
        os.unlink(planted)
    except OSError as error:
        failed["workspace"].append(error.strerror)
    beside = os.path.join(workspace, "..", marker)
    try:
        os.mkdir(beside, 0o700)
        failed["beside"].append("made a directory")
    except OSError:
        pass  # EROFS, as it should be (or EEXIST: the runner's own, if it made one)
    try:
        os.close(os.open(os.path.join(beside, "marker"), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        failed["beside"].append("wrote a file")
    except OSError:
        pass
    try:
        if not os.statvfs("/").f_flag & os.ST_RDONLY:
            failed["beside"].append("the root file system is writable")
        parent = os.stat(os.path.join(workspace, ".."))
        if [parent.st_dev, parent.st_ino] == host_parent:
            failed["beside"].append("the workspace's parent is the host's")
    except OSError as error:
        failed["beside"].append(error.strerror)
    return failed if failed["workspace"] or failed["beside"] else None


def run(request, connection):
    tmpdir = request["tmpdir"]
    try:
        os.mkdir(tmpdir, 0o700)
    except OSError as error:
        return {"error": f"cannot make TMPDIR: {error.strerror}"}
    env = dict(request["env"], TMPDIR=tmpdir)
    limit = int(request["output_limit"])
    oom_before = oom_kills()
    started = time.monotonic()
    try:
        child = subprocess.Popen(
            request["argv"],
            env=env,
            cwd=request["cwd"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,
        )
    except OSError as error:
        # What a shell would say and exit with for a command it cannot run.
        code = 127 if isinstance(error, FileNotFoundError) else 126
        message = f"{request['argv'][0]}: {error.strerror}\n".encode()
        return answer_for(code, b"", message, False, False, 0, started)
    outputs, truncated, timed_out = collect(child, connection, request, limit)
    exit_code = 137 if timed_out else child.wait()
    return answer_for(
        exit_code,
        outputs[child.stdout.fileno()],
        outputs[child.stderr.fileno()],
        truncated,
        timed_out,
        oom_kills() - oom_before,
        started,
    )


def collect(child, connection, request, limit):
    """Read the command's output until it exits (or times out), then end everything else.

    The command's exit is seen through a pidfd, so a background child that keeps the pipes
    open cannot hold the call; the connection is readable only when the runner left.
    """
    deadline = time.monotonic() + float(request["timeout_s"])
    selector = selectors.DefaultSelector()
    outputs = {}
    for stream in (child.stdout, child.stderr):
        outputs[stream.fileno()] = b""
        selector.register(stream, selectors.EVENT_READ, "output")
    selector.register(connection, selectors.EVENT_READ, "runner")
    exit_fd = os.pidfd_open(child.pid)
    selector.register(exit_fd, selectors.EVENT_READ, "exit")
    truncated = timed_out = ended = False
    try:
        while True:
            if not ended and child.poll() is not None:
                ended = True
                kill_all()  # background children die with the call; their pipes close
            if ended and not any(key.data == "output" for key in selector.get_map().values()):
                break
            remaining = deadline - time.monotonic()
            if not ended and remaining <= 0:
                timed_out = ended = True
                kill_all()
                continue
            for key, _ in selector.select(timeout=None if ended else remaining):
                if key.data == "exit":
                    selector.unregister(exit_fd)  # seen; the loop's poll() reaps it
                elif key.data == "runner":
                    selector.unregister(connection)
                    if not ended:
                        ended = True
                        kill_all()  # the runner is gone: nothing may go on unattended
                else:
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    room = limit - len(outputs[key.fd])
                    truncated = truncated or len(chunk) > room
                    outputs[key.fd] += chunk[: max(room, 0)]
    finally:
        os.close(exit_fd)
        selector.close()
    return outputs, truncated, timed_out


def kill_all():
    """SIGKILL every process of the container but this one, and reap them."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)


def clean_up():
    """Remove what the call left in the container's scratch space and IPC namespace (every
    other process is dead by now); what could not be removed."""
    for directory in SCRATCH:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
    return [] if remove_sysv_ipc() else ["SysV IPC objects"]


def remove_sysv_ipc():
    """Remove every SysV IPC object of the container; True if none is left afterwards."""
    clean = True
    for kind in SYSV_IPC:
        ids = sysv_ids(kind)
        if not ids:  # the usual case: nothing to remove (or, None, cannot tell)
            clean = clean and ids == []
            continue
        for ipc_id in ids:
            if kind == "shm":
                LIBC.shmctl(ipc_id, IPC_RMID, None)
            elif kind == "msg":
                LIBC.msgctl(ipc_id, IPC_RMID, None)
            else:
                LIBC.semctl(ipc_id, 0, IPC_RMID)
        clean = clean and sysv_ids(kind) == []
    return clean


def sysv_ids(kind):
    """The ids of one kind of SysV IPC object in this IPC namespace; None if unreadable."""
    try:
        with open(f"/proc/sysvipc/{kind}") as table:
            rows = table.read().splitlines()[1:]
        return [int(row.split()[1]) for row in rows if row.strip()]
    except (OSError, ValueError, IndexError):
        return None


def oom_kills():
    for path in OOM_COUNTERS:
        try:
            with open(path) as counters:
                for line in counters:
                    name, _, value = line.partition(" ")
                    if name == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def answer_for(exit_code, stdout, stderr, truncated, timed_out, oom, started):
    return {
        "exit_code": exit_code,
        "stdout": base64.b64encode(stdout).decode(),
        "stderr": base64.b64encode(stderr).decode(),
        "truncated": truncated,
        "timed_out": timed_out,
        "oom_kills": oom,
        "duration_ms": int((time.monotonic() - started) * 1000),
    }


if __name__ == "__main__":
    main(sys.argv[1])
