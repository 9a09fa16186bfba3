"""Webhook test fixtures: a TLS identity for the consumer, and the consumer itself."""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.webhooks.consumer import make_server, read_log

# A name only the tests' patched resolver knows; the certificate is issued for it.
TEST_HOST = "hooks.kestrel.test"


@pytest.fixture(scope="session")
def tls_identity(tmp_path_factory) -> dict[str, Path]:
    """A self-signed certificate for localhost, 127.0.0.1 and TEST_HOST (its own CA)."""
    base = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kestrel webhook consumer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName(TEST_HOST),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = base / "consumer.pem", base / "consumer.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return {"cert": cert_path, "key": key_path}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Consumer:
    port: int
    secrets_file: Path
    log_file: Path

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"https://{host}:{self.port}{path}"

    def trust(self, prefix: str, *secrets: str) -> None:
        """Verify requests under ``prefix`` with these secrets (read on every request)."""
        current = json.loads(self.secrets_file.read_text()) if self.secrets_file.exists() else {}
        current[prefix] = list(secrets)
        self.secrets_file.write_text(json.dumps(current))

    def received(self) -> list[dict]:
        return read_log(self.log_file)


@pytest.fixture
def consumer_thread(tmp_path, tls_identity):
    """The consumer in a thread of the test process, for in-process delivery tests."""
    consumer = Consumer(free_port(), tmp_path / "secrets.json", tmp_path / "received.jsonl")
    server = make_server(
        port=consumer.port,
        cert=tls_identity["cert"],
        key=tls_identity["key"],
        secrets_file=consumer.secrets_file,
        log_file=consumer.log_file,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield consumer
    server.shutdown()
    server.server_close()


@pytest.fixture
def webhook_settings(settings, tls_identity):
    """Loopback allowlisted (tests only), the consumer's CA trusted, tiny retry delays."""
    settings.KESTREL_WEBHOOK_ALLOW_ADDRESSES = ["127.0.0.1/32"]
    settings.KESTREL_EGRESS_OVERRIDES_IN_HOSTED = True  # the tests run in hosted mode
    settings.KESTREL_WEBHOOK_CA_BUNDLE = str(tls_identity["cert"])
    settings.KESTREL_WEBHOOK_RETRY_DELAYS = [0.01, 0.01, 0.01]
    settings.KESTREL_WEBHOOK_TIMEOUT_SECONDS = 5
    return settings
