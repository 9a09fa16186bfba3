"""The runner's side of the broker beside the sandbox (CRED-3), against real sandboxes.

A real broker (runners.adapter_broker) serves a real network-less Docker container (fresh
and warm) and a bubblewrap sandbox; the control plane is played by a transport that
checks the runner's signature and answers with the control key, so what crosses the
socket, what is signed and what the workload gets back are all real.
"""

from __future__ import annotations

import json
import queue
import time
import uuid
from pathlib import Path

import pytest

from runners.adapter_broker import AdapterBroker
from runners.contract.adapter_broker import (
    reply_key,
    sign_adapter_answer,
    verify_adapter_request,
)
from runners.contract.tokens import generate_private_key_pem, load_private_key
from runners.sandbox import ConfinedSandbox, ExecLimits, ExecSpec, WarmDockerBackend
from runners.sandbox.base import SANDBOX_ADAPTER_SOCKET

pytestmark = [pytest.mark.spec("CRED-3")]

POOL = "default"
LIMITS = ExecLimits(timeout_s=30, memory_mb=128, cpus=0.5, pids=40, output_kb=64, tmp_mb=8)
RUNNER_KEY = load_private_key(generate_private_key_pem())
CONTROL_KEY = load_private_key(generate_private_key_pem())
# A direct connection from inside: to a public address, which a network-less sandbox
# cannot reach whatever the host's routes.
DIRECT = (
    "import socket\n"
    "try:\n"
    "    socket.create_connection(('1.1.1.1', 443), timeout=3)\n"
    "    print('CONNECTED')\n"
    "except OSError as error:\n"
    "    print('NO NETWORK', type(error).__name__)\n"
)
# The client's protocol without the client (bubblewrap sees the host's /usr, not the image).
RAW_CLIENT = (
    "import json, os, socket, sys\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.connect(os.environ['KESTREL_ADAPTER_SOCKET'])\n"
    "s.sendall(sys.argv[1].encode() + b'\\n')\n"
    "s.shutdown(socket.SHUT_WR)\n"
    "print(s.makefile().read())\n"
)


class FakeControlPlane:
    """The control plane's part: verify the runner's signature, answer with the control key.

    ``answer`` picks the outcome per request: (outcome, result, error), or None for none.
    """

    def __init__(self, runner_id: str, answer=None) -> None:
        self.runner_id = runner_id
        self.requests: list = []
        self.answer = answer or (lambda request: ("succeeded", {"status": 200, "n": 1}, None))
        self._replies: dict[str, queue.Queue] = {}

    def send(self, token: str) -> None:
        request = verify_adapter_request(
            token, runner_public_key=RUNNER_KEY.public_key(), runner_id=self.runner_id
        )
        self.requests.append(request)
        chosen = self.answer(request)
        box = self._replies.setdefault(reply_key(POOL, request.request_id), queue.Queue())
        if chosen is not None:
            outcome, result, error = chosen
            box.put(
                sign_adapter_answer(
                    pool=POOL,
                    request_id=request.request_id,
                    call_id=request.call_id,
                    action="act_child",
                    outcome=outcome,
                    result=result,
                    error=error,
                    private_key=CONTROL_KEY,
                )
            )

    def wait(self, key: str, timeout_s: float) -> str | None:
        try:
            return self._replies.setdefault(key, queue.Queue()).get(timeout=min(timeout_s, 5))
        except queue.Empty:
            return None


def open_broker(control: FakeControlPlane, call_id: str, *, started=None) -> AdapterBroker:
    return AdapterBroker(
        call_id=call_id,
        command_digest="c" * 64,
        runner_id=control.runner_id,
        pool=POOL,
        private_key=RUNNER_KEY,
        control_public_key=CONTROL_KEY.public_key(),
        transport=control,
        deadline=time.monotonic() + 30,
        before_request=started or (lambda: None),
    )


def sandbox(backend, workspace: Path, labels: dict, broker: AdapterBroker) -> ConfinedSandbox:
    return ConfinedSandbox(
        backend, workspace=workspace, limits=LIMITS, labels=labels, adapter_dir=broker.directory
    )


@pytest.mark.docker
def test_a_network_less_container_reaches_an_adapter_only_through_the_broker(
    docker_backend, engine, workspace, project
):
    control = FakeControlPlane("run_broker0test")
    started = []
    labels = {"call": f"act_{uuid.uuid4().hex[:20]}", "project": project}
    with open_broker(control, labels["call"], started=lambda: started.append(1)) as broker:
        box = sandbox(docker_backend, workspace, labels, broker)
        direct = box.run(("python3", "-c", DIRECT))
        called = box.run(
            (
                "kestrel-adapter",
                "github",
                "issues.list",
                '{"owner": "kestrel", "repo": "one"}',
                "--credential",
                "crd_01TEST",
            )
        )
    assert direct.stdout.startswith("NO NETWORK"), direct.stdout + direct.stderr
    assert called.exit_code == 0, called.stderr
    assert json.loads(called.stdout) == {"status": 200, "n": 1}
    [request] = control.requests
    assert request.call_id == labels["call"] and request.command_digest == "c" * 64
    assert request.request == {
        "adapter": "github",
        "operation": "issues.list",
        "args": {"owner": "kestrel", "repo": "one"},
        "credential": "crd_01TEST",
    }
    assert started == [1]  # the call's started report went out before its first request
    # The container has no network at all, and the socket's directory is read-only.
    spec = ExecSpec(argv=("true",), workspace=workspace, adapter_dir=Path("/tmp"))
    options = docker_backend.container_options(spec)
    assert options["network_mode"] == "none"
    assert options["environment"]["KESTREL_ADAPTER_SOCKET"] == SANDBOX_ADAPTER_SOCKET
    adapter_mount = options["mounts"][-1]
    assert (adapter_mount["Target"], adapter_mount["ReadOnly"]) == ("/run/kestrel-adapter", True)
    assert not broker.directory.exists()  # removed with the call


@pytest.mark.docker
def test_a_refusal_reaches_the_workload_as_an_error_and_a_non_zero_exit(
    docker_backend, engine, workspace, project
):
    control = FakeControlPlane(
        "run_broker0test",
        answer=lambda request: (
            "denied",
            None,
            {"code": "policy_denied", "message": "external operations are not enabled"},
        ),
    )
    labels = {"call": f"act_{uuid.uuid4().hex[:20]}", "project": project}
    with open_broker(control, labels["call"]) as broker:
        box = sandbox(docker_backend, workspace, labels, broker)
        refused = box.run(
            ("kestrel-adapter", "slack", "chat.postMessage", '{"channel": "C1", "text": "hi"}')
        )
        invalid = box.run(("kestrel-adapter", "slack", "chat.postMessage", "[1]"))
        unknown = box.run(
            (
                "sh",
                "-c",
                'printf \'%s\\n\' \'{"adapter":"slack","operation":"x","url":"http://e"}\''
                ' | python3 -c "import os,socket,sys;s=socket.socket(socket.AF_UNIX);'
                "s.connect(os.environ['KESTREL_ADAPTER_SOCKET']);s.sendall(sys.stdin.buffer.read());"
                's.shutdown(1);print(s.makefile().read())"',
            )
        )
    assert refused.exit_code == 1
    error = json.loads(refused.stderr)
    assert error["code"] == "policy_denied" and error["outcome"] == "denied"
    assert error["action"] == "act_child"
    assert refused.stdout == ""
    # Shapes the broker refuses itself: nothing is signed or sent for them.
    assert invalid.exit_code == 1 and json.loads(invalid.stderr)["code"] == "invalid_request"
    assert json.loads(unknown.stdout)["error"]["code"] == "invalid_request"
    assert "url" in json.loads(unknown.stdout)["error"]["message"]
    assert len(control.requests) == 1


@pytest.mark.docker
def test_a_warm_container_reaches_each_calls_own_broker(docker_backend, engine, workspace, project):
    warm = WarmDockerBackend(docker_backend, idle_seconds=60, max_containers=4)
    control = FakeControlPlane(
        "run_broker0test",
        answer=lambda request: ("succeeded", {"call": request.call_id}, None),
    )
    thread = f"thr_{uuid.uuid4().hex[:12]}"
    answers = []
    try:
        for _ in range(2):
            labels = {"call": f"act_{uuid.uuid4().hex[:20]}", "project": project, "thread": thread}
            with open_broker(control, labels["call"]) as broker:
                box = sandbox(warm, workspace, labels, broker)
                result = box.run(("kestrel-adapter", "github", "issues.list", "{}"))
            assert result.exit_code == 0, result.stderr
            answers.append((labels["call"], json.loads(result.stdout)["call"]))
        assert len(warm.warm_containers()) == 1  # one container served both calls
        # A call without a broker finds nothing there: the link went with the call.
        gone = ConfinedSandbox(
            warm,
            workspace=workspace,
            limits=LIMITS,
            labels={"call": "act_none", "project": project, "thread": thread},
        ).run(("sh", "-c", f"ls -A /run/kestrel-adapter; test -e {SANDBOX_ADAPTER_SOCKET}"))
    finally:
        warm.close()
    assert [call for call, _ in answers] == [answered for _, answered in answers]
    assert gone.exit_code == 1 and gone.stdout == ""


def test_bubblewrap_mounts_the_broker_socket_and_keeps_the_network_empty(bwrap_backend, workspace):
    control = FakeControlPlane("run_broker0test")
    labels = {"call": f"act_{uuid.uuid4().hex[:20]}", "project": "prj_test"}
    request = json.dumps({"adapter": "github", "operation": "issues.list", "args": {}})
    with open_broker(control, labels["call"]) as broker:
        box = sandbox(bwrap_backend, workspace, labels, broker)
        direct = box.run(("python3", "-c", DIRECT))
        called = box.run(("python3", "-c", RAW_CLIENT, request))
    assert direct.stdout.startswith("NO NETWORK"), direct.stdout + direct.stderr
    assert called.exit_code == 0, called.stderr
    answer = json.loads(called.stdout)
    assert answer["ok"] is True and answer["result"] == {"status": 200, "n": 1}
    assert len(control.requests) == 1


def test_the_broker_bounds_requests_and_answers_a_timeout(tmp_path):
    """No answer within the call's time: the workload is told so, not left hanging."""
    import socket as socket_module

    control = FakeControlPlane("run_broker0test", answer=lambda request: None)
    with open_broker(control, "act_timeout") as broker:
        broker.deadline = time.monotonic() + 3  # answered within ~2 s (the margin is 1 s)

        def ask(body: bytes) -> dict:
            with socket_module.socket(socket_module.AF_UNIX) as connection:
                connection.connect(str(broker.socket_path))
                connection.sendall(body)
                connection.shutdown(socket_module.SHUT_WR)
                return json.loads(connection.makefile().read())

        timed_out = ask(b'{"adapter": "github", "operation": "issues.list", "args": {}}\n')
        too_large = ask(b'{"adapter": "' + b"x" * (70 * 1024) + b'"}')
        duplicate = ask(b'{"adapter": "a", "adapter": "b", "operation": "o"}')
    assert timed_out["ok"] is False and timed_out["error"]["code"] == "timeout"
    assert too_large["error"]["code"] == "request_too_large"
    assert duplicate["error"]["code"] == "invalid_request"
    assert len(control.requests) == 1
