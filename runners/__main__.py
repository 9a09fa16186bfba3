"""``python -m runners``: start a runner worker, make its key pair, show its public key.

The private key is made and kept on the runner host; only the public key (printed) goes
to the control plane when the runner is enrolled.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from runners.config import RunnerConfig, RunnerConfigError
from runners.contract.tokens import generate_private_key_pem, public_key_pem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runners",
        description="Kestrel One runner: executes signed tool calls in sandboxes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker",
        help="run the Celery worker for this runner's pool (configured by KESTREL_* variables)",
        description=(
            "Run `celery -A runners.worker worker -Q runner.<pool>`. Reads KESTREL_RUNNER_ID, "
            "KESTREL_RUNNER_POOL, KESTREL_RUNNER_KEY_FILE, KESTREL_CONTROL_PUBLIC_KEY_FILE, "
            "KESTREL_BROKER_URL, KESTREL_WORKSPACE_ROOT and optionally "
            "KESTREL_RUNNER_STATE_URL, KESTREL_SANDBOX, KESTREL_MAX_CALL_SECONDS, "
            "KESTREL_STARTED_REPORT_DELAY_SECONDS, KESTREL_WARM_SANDBOXES, "
            "KESTREL_WARM_IDLE_SECONDS, KESTREL_WARM_MAX_CONTAINERS, KESTREL_WARM_AGENT_DIR, "
            "KESTREL_ADAPTER_BROKER_DIR."
        ),
    )
    worker.add_argument(
        "--concurrency",
        type=int,
        default=os.cpu_count() or 1,
        help="calls run at once (default: CPU count)",
    )
    worker.add_argument("--loglevel", default="INFO", help="Celery log level (default INFO)")

    keygen = commands.add_parser(
        "keygen",
        help="write a new Ed25519 private key (mode 0600) and print its public key",
    )
    keygen.add_argument("--out", required=True, type=Path, help="where to write the key")

    show = commands.add_parser(
        "public-key", help="print the public key of an existing private key file"
    )
    show.add_argument("--key", required=True, type=Path, help="the private key PEM file")

    options = parser.parse_args(argv)
    if options.command == "worker":
        return _worker(options.concurrency, options.loglevel)
    if options.command == "keygen":
        return _keygen(options.out)
    return _public_key(options.key)


def _worker(concurrency: int, loglevel: str) -> int:
    if concurrency < 1:
        print("--concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        config = RunnerConfig.from_environment()
    except RunnerConfigError as error:
        print(f"runner configuration error: {error}", file=sys.stderr)
        return 2
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runners.worker",
        "worker",
        "-Q",
        config.queue,
        "--hostname",
        f"{config.runner_id}@%h",
        "--concurrency",
        str(concurrency),
        "--loglevel",
        loglevel,
        # A runner needs none of Celery's worker-to-worker chatter.
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    sys.stdout.flush()
    # Replace this process, so signals (and a supervisor) reach Celery directly.
    os.execv(sys.executable, argv)  # noqa: S606 - fixed argv, no shell
    return 0  # not reached


def _keygen(out: Path) -> int:
    private_pem = generate_private_key_pem()
    try:
        # O_EXCL: never overwrite an enrolled key by accident; 0600 from the first byte.
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        print(f"{out} already exists; refusing to overwrite a key", file=sys.stderr)
        return 1
    with os.fdopen(fd, "wb") as file:
        file.write(private_pem)
    os.chmod(out, 0o600)
    sys.stdout.write(public_key_pem(private_pem).decode("ascii"))
    return 0


def _public_key(key: Path) -> int:
    try:
        sys.stdout.write(public_key_pem(key.read_bytes()).decode("ascii"))
    except (OSError, ValueError, TypeError) as error:
        print(f"cannot read a private key from {key}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
