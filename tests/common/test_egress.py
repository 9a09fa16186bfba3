"""The one egress client (CRED-2): TLS verified, redirects refused, internal addresses refused
with nothing sent, the checked address is the one connected to, time and bytes bounded,
operator overrides only for the exact host and never silently in hosted mode, and no request
header or body in any failure's text.

Everything here crosses a real socket and real TLS to the test upstream (tests/upstream.py).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import ssl
import threading
import traceback

import pytest
import trustme
import urllib3.util.connection

from kestrel_one.common import egress
from kestrel_one.common.egress import EgressFailed, EgressRefused, egress_request, egress_stream
from tests.test_settings import HOSTED, run_manage
from tests.upstream import DEFAULT_SECRETS, iter_sse, make_server, random_secret

GITHUB = DEFAULT_SECRETS["api.github.com"]
LOOPBACK = [ipaddress.ip_network("127.0.0.1/32")]


def _get(url: str, **kwargs) -> egress.EgressAnswer:
    options = {"headers": {}, "body": None, "timeout_s": 10.0, "max_bytes": 1 << 20}
    options.update(kwargs)
    return egress_request(method=options.pop("method", "GET"), url=url, **options)


@pytest.fixture
def connections(monkeypatch) -> list[tuple[str, int]]:
    """Every (address, port) the client opens a socket to."""
    opened: list[tuple[str, int]] = []
    real = urllib3.util.connection.create_connection

    def recording(address, *args, **kwargs):
        opened.append((address[0], address[1]))
        return real(address, *args, **kwargs)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", recording)
    return opened


def resolving(monkeypatch, answers: dict[str, list[list[str]]]) -> list[str]:
    """Patch the resolver: each lookup of a name takes its next answer (the last repeats);
    address literals pass through. Returns the names looked up, in order."""
    looked_up: list[str] = []
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):
        if host not in answers:
            ipaddress.ip_address(host)  # only literals may reach the real resolver here
            return real(host, port, *args, **kwargs)
        looked_up.append(host)
        sequence = answers[host]
        addresses = sequence[min(len(looked_up_for(host)) - 1, len(sequence) - 1)]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    def looked_up_for(host):
        return [name for name in looked_up if name == host]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return looked_up


# Reaching a provider ------------------------------------------------------------------------


@pytest.mark.spec("CRED-2")
def test_a_provider_name_reaches_the_upstream_with_its_name_in_host_sni_and_certificate(
    upstream, connections
):
    answer = _get(
        "https://api.github.com/repos/octo/hello/issues?state=all",
        headers={"Authorization": f"Bearer {GITHUB}", "Host": "evil.example.com"},
    )
    assert answer.status == 200
    assert [issue["number"] for issue in json.loads(answer.body)] == [3, 2, 1]
    assert answer.headers["content-type"].startswith("application/json")
    (received,) = upstream.requests(host="api.github.com", path="/repos/octo/hello/issues")
    assert received["headers"]["host"] == "api.github.com"  # a caller's Host never wins
    assert received["query"] == "state=all"
    assert connections == [("127.0.0.1", upstream.port)]


@pytest.mark.spec("CRED-2")
def test_a_server_whose_certificate_is_not_trusted_fails_with_tls_failed(
    upstream, settings, tmp_path
):
    """Same name, same address form, a certificate from a CA nobody trusts: nothing is sent."""
    other_ca = trustme.CA()
    pem = tmp_path / "untrusted.pem"
    other_ca.issue_cert("api.github.com", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(pem)
    )
    server = make_server(
        port=0, server_pem=pem, log_file=tmp_path / "log.jsonl", secrets_file=tmp_path / "s.json"
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings.KESTREL_EGRESS_HOST_OVERRIDES = {
            "api.github.com": ("127.0.0.1", server.server_address[1])
        }
        with pytest.raises(EgressFailed) as failed:
            _get("https://api.github.com/repos/octo/hello/issues")
        assert failed.value.code == "tls_failed"
        assert not (tmp_path / "log.jsonl").read_text()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.spec("CRED-2")
def test_a_certificate_for_another_name_fails_with_tls_failed(upstream, settings):
    settings.KESTREL_EGRESS_HOST_OVERRIDES = {
        **settings.KESTREL_EGRESS_HOST_OVERRIDES,
        "api.gitlab.com": ("127.0.0.1", upstream.port),
    }
    with pytest.raises(EgressFailed) as failed:
        _get("https://api.gitlab.com/landed")
    assert failed.value.code == "tls_failed"
    assert "api.gitlab.com" in failed.value.message
    assert upstream.requests() == []


@pytest.mark.spec("CRED-2")
@pytest.mark.parametrize("target", ["/landed", "https://slack.com/landed"])
def test_a_redirect_is_refused_and_its_target_gets_no_request(upstream, target):
    with pytest.raises(EgressFailed) as failed:
        _get(f"https://api.github.com/redirect?to={target}")
    assert (failed.value.code, failed.value.status) == ("redirect_refused", 302)
    with (
        pytest.raises(EgressFailed) as streamed,
        egress_stream(
            method="GET",
            url=f"https://api.github.com/redirect?to={target}",
            headers={},
            body=None,
            timeout_s=10,
            max_bytes=1000,
        ),
    ):
        pass
    assert streamed.value.code == "redirect_refused"
    assert len(upstream.requests(path="/redirect")) == 2
    assert upstream.requests(path="/landed") == []


# Addresses ----------------------------------------------------------------------------------

REFUSED = [
    "127.0.0.1",
    "127.8.9.10",
    "10.0.0.1",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "169.254.170.2",  # container credentials endpoint
    "100.64.0.1",  # CGNAT
    "0.0.0.0",  # noqa: S104 (an address to refuse, not one to bind)
    "224.0.0.1",
    "240.0.0.1",
    "::1",
    "fe80::1",
    "fd00::1",
    "fd00:ec2::254",  # IPv6 metadata
    "fec0::1",  # deprecated site-local, which some networks still route inside
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:169.254.169.254",
    "::ffff:10.0.0.1",
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "2002:7f00:1::",  # 6to4 of 127.0.0.1
]


@pytest.mark.spec("CRED-2")
@pytest.mark.parametrize("address", REFUSED)
def test_an_internal_address_is_refused_and_nothing_is_sent(
    upstream, monkeypatch, connections, address
):
    literal = f"[{address}]" if ":" in address else address
    with pytest.raises(EgressRefused) as literal_refused:
        _get(f"https://{literal}/")
    assert literal_refused.value.code == "destination_refused"

    resolving(monkeypatch, {"internal.example.com": [[address]]})
    with pytest.raises(EgressRefused) as name_refused:
        _get("https://internal.example.com/")
    # The name and why, never what it resolves to: whoever chose the name (a tenant's
    # webhook URL) would learn an internal address.
    message = name_refused.value.message
    assert message.startswith("internal.example.com resolves to an address that is ")
    assert str(ipaddress.ip_address(address)) not in message
    assert connections == []


@pytest.mark.spec("CRED-2")
def test_one_internal_answer_among_public_ones_refuses_the_name(monkeypatch, connections):
    resolving(monkeypatch, {"mixed.example.com": [["93.184.215.14", "169.254.169.254"]]})
    with pytest.raises(EgressRefused) as refused:
        _get("https://mixed.example.com/")
    assert refused.value.message == (
        "mixed.example.com resolves to an address that is link-local (cloud metadata lives here)"
    )
    assert connections == []


def test_a_name_that_does_not_resolve_is_refused(monkeypatch, connections):
    def failing(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", failing)
    with pytest.raises(EgressRefused, match="does not resolve"):
        _get("https://nowhere.example.com/")
    assert connections == []


@pytest.mark.spec("CRED-2")
def test_a_dns_answer_that_changes_after_the_check_cannot_move_the_connection(
    upstream, monkeypatch, connections
):
    """Resolved once: the second answer (metadata) is never asked for, and the only socket
    opened goes to the first, checked address; TLS still verifies the name."""
    looked_up = resolving(
        monkeypatch, {"upstream.kestrel.test": [["127.0.0.1"], ["169.254.169.254"]]}
    )
    answer = _get(f"https://upstream.kestrel.test:{upstream.port}/landed", allow_addresses=LOOPBACK)
    assert answer.status == 200
    assert looked_up == ["upstream.kestrel.test"]
    assert connections == [("127.0.0.1", upstream.port)]
    (received,) = upstream.requests(path="/landed")
    assert received["headers"]["host"] == f"upstream.kestrel.test:{upstream.port}"


@pytest.mark.spec("CRED-2")
def test_a_first_dns_answer_that_is_internal_refuses_even_if_a_later_one_would_not(
    upstream, monkeypatch, connections
):
    resolving(monkeypatch, {"upstream.kestrel.test": [["169.254.169.254"], ["127.0.0.1"]]})
    with pytest.raises(EgressRefused, match="link-local"):
        _get(f"https://upstream.kestrel.test:{upstream.port}/landed", allow_addresses=LOOPBACK)
    assert connections == []
    assert upstream.requests() == []


# Bounds ------------------------------------------------------------------------------------


@pytest.mark.spec("CRED-2")
@pytest.mark.parametrize("query", ["seconds=30", "seconds=30&drip=1"])
def test_time_is_bounded_for_a_late_answer_and_for_a_dripping_one(upstream, query):
    with pytest.raises(EgressFailed) as failed:
        _get(f"https://api.openai.com/slow?{query}", timeout_s=1.0)
    assert failed.value.code == "timeout"


@pytest.mark.spec("CRED-2")
@pytest.mark.parametrize("query", ["bytes=2000000", "bytes=2000000&chunked=1"])
def test_an_answer_over_max_bytes_fails_rather_than_being_cut(upstream, query):
    with pytest.raises(EgressFailed) as failed:
        _get(f"https://api.anthropic.com/huge?{query}", max_bytes=1_000_000)
    assert failed.value.code == "response_too_large"


def test_an_answer_of_exactly_max_bytes_is_read_whole(upstream):
    answer = _get("https://api.anthropic.com/huge?bytes=100000&chunked=1", max_bytes=100_000)
    assert answer.body == b"x" * 100_000


def test_a_closed_port_is_connect_failed(settings, upstream):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    settings.KESTREL_EGRESS_HOST_OVERRIDES = {"api.github.com": ("127.0.0.1", closed)}
    with pytest.raises(EgressFailed) as failed:
        _get("https://api.github.com/landed")
    assert failed.value.code == "connect_failed"


def test_only_https_unless_the_caller_allows_http(upstream, connections):
    with pytest.raises(EgressRefused, match="https"):
        _get("http://api.github.com/landed")
    with pytest.raises(EgressRefused, match="credentials"):
        _get("https://user:pw@api.github.com/landed")
    assert connections == []


# Operator overrides -------------------------------------------------------------------------


@pytest.mark.spec("CRED-2")
@pytest.mark.parametrize(
    "host",
    ["uploads.api.github.com", "api.github.com.evil.example", "github.com", "api-github.com"],
)
def test_an_override_applies_to_its_exact_host_only(upstream, monkeypatch, connections, host):
    """Names near an overridden one resolve as usual (here: to loopback) and are refused."""
    resolving(monkeypatch, {host: [["127.0.0.1"]]})
    with pytest.raises(EgressRefused, match="loopback"):
        _get(f"https://{host}/landed")
    assert connections == []
    assert upstream.requests() == []


def test_an_override_matches_the_name_in_any_case(upstream):
    assert _get("https://API.GitHub.com/landed").status == 200


@pytest.mark.spec("CRED-2")
@pytest.mark.parametrize("setting", ["KESTREL_EGRESS_HOST_OVERRIDES", "KESTREL_EGRESS_CA_BUNDLE"])
def test_overrides_are_refused_in_hosted_mode_unless_enabled(
    upstream, settings, connections, setting
):
    settings.HOSTED = True
    settings.KESTREL_EGRESS_OVERRIDES_IN_HOSTED = False
    other = (
        "KESTREL_EGRESS_CA_BUNDLE"
        if setting == "KESTREL_EGRESS_HOST_OVERRIDES"
        else "KESTREL_EGRESS_HOST_OVERRIDES"
    )
    setattr(settings, other, None)
    with pytest.raises(EgressRefused, match=setting):
        _get("https://api.github.com/landed")
    assert connections == []
    assert upstream.requests() == []

    settings.SINGLE_HOST, settings.HOSTED = True, False  # outside hosted mode: allowed
    settings.KESTREL_EGRESS_HOST_OVERRIDES = upstream.overrides
    settings.KESTREL_EGRESS_CA_BUNDLE = upstream.ca_bundle
    assert _get("https://api.github.com/landed").status == 200


@pytest.mark.spec("CRED-2")
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KESTREL_EGRESS_HOST_OVERRIDES", "api.github.com=127.0.0.1:8443"),
        ("KESTREL_EGRESS_CA_BUNDLE", "/etc/hostname"),
    ],
)
def test_hosted_startup_refuses_the_overrides_unless_explicitly_enabled(variable, value):
    refused = run_manage({**HOSTED, variable: value}, "check")
    assert refused.returncode != 0
    assert f"{variable} is refused in hosted mode" in refused.stderr

    enabled = run_manage(
        {**HOSTED, variable: value, "KESTREL_EGRESS_OVERRIDES_IN_HOSTED": "1"}, "check"
    )
    assert enabled.returncode == 0, enabled.stderr[-2000:]


@pytest.mark.parametrize(
    "value", ["api.github.com", "api.github.com=example.com:443", "a=127.0.0.1:99999", "=1.2.3.4"]
)
def test_a_malformed_override_stops_startup_naming_the_variable(value):
    result = run_manage({"KESTREL_EGRESS_HOST_OVERRIDES": value}, "check")
    assert result.returncode != 0
    assert "KESTREL_EGRESS_HOST_OVERRIDES" in result.stderr


def test_overrides_parse():
    assert egress.host_overrides_parse(" API.github.com=127.0.0.1:8443, x.test=[::1]:9,y=::1") == {
        "api.github.com": ("127.0.0.1", 8443),
        "x.test": ("::1", 9),
        "y": ("::1", None),
    }


# Secret-free failures -----------------------------------------------------------------------


class _GarbageServer:
    """TLS with the upstream's certificate, then an answer that is not HTTP."""

    def __init__(self, server_pem: str):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(server_pem)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.context = context
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(raw, server_side=True) as conn:
                    conn.recv(65536)
                    conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            except (OSError, ssl.SSLError):
                pass

    def close(self):
        self.listener.close()


@pytest.mark.spec("CRED-2")
def test_no_failure_carries_a_request_header_body_path_or_query(upstream, settings, monkeypatch):
    canary = random_secret()
    headers = {"Authorization": f"Bearer {canary}", "X-Api-Key": canary, "Cookie": canary}
    garbage = _GarbageServer(str(upstream.directory / "upstream-server.pem"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    settings.KESTREL_EGRESS_HOST_OVERRIDES = {
        **settings.KESTREL_EGRESS_HOST_OVERRIDES,
        "localhost": ("127.0.0.1", garbage.port),
        "api.gitlab.com": ("127.0.0.1", upstream.port),
        "closed.kestrel.test": ("127.0.0.1", closed),
    }
    resolving(monkeypatch, {"internal.example.com": [["10.0.0.1"]]})
    q = f"?token={canary}"
    cases = [
        ("destination_refused", f"https://127.0.0.1/{canary}{q}", {}),
        ("destination_refused", f"https://internal.example.com/{canary}{q}", {}),
        ("destination_refused", f"http://api.github.com/{canary}{q}", {}),
        ("tls_failed", f"https://api.gitlab.com/{canary}{q}", {}),
        ("redirect_refused", f"https://api.github.com/redirect?to=/{canary}", {}),
        ("timeout", f"https://api.github.com/slow?seconds=30&t={canary}", {"timeout_s": 0.5}),
        ("timeout", f"https://api.github.com/slow?seconds=30&drip=1&t={canary}", {"timeout_s": 1}),
        ("response_too_large", f"https://api.github.com/huge?t={canary}", {"max_bytes": 10}),
        (
            "response_too_large",
            f"https://api.github.com/huge?chunked=1&t={canary}",
            {"max_bytes": 10},
        ),
        ("connect_failed", f"https://closed.kestrel.test/{canary}{q}", {}),
        ("protocol_error", f"https://localhost/{canary}{q}", {}),
    ]
    with pytest.raises(EgressRefused) as malformed:
        _get("https://api.github.com/landed", headers={"Authorization": f"Bearer {canary}\r\nX: 1"})
    assert canary not in "".join(traceback.format_exception(malformed.value))
    assert upstream.requests() == []
    try:
        for code, url, options in cases:
            with pytest.raises((EgressRefused, EgressFailed)) as raised:
                _get(url, method="POST", headers=headers, body=canary.encode(), **options)
            error = raised.value
            assert error.code == code, (url, error.message)
            texts = [
                str(error),
                repr(error),
                error.message,
                "".join(traceback.format_exception(error)),
            ]
            assert not any(canary in text for text in texts), (code, texts)
    finally:
        garbage.close()


# Streams -----------------------------------------------------------------------------------


def test_a_stream_arrives_as_server_sent_events_with_usage(upstream):
    body = (
        b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"say hi"}],'
        b'"stream":true,"stream_options":{"include_usage":true}}'
    )
    with egress_stream(
        method="POST",
        url="https://api.openai.com/v1/chat/completions",
        headers={
            "Authorization": f"Bearer {upstream.secret('openai')}",
            "Content-Type": "application/json",
        },
        body=body,
        timeout_s=10,
        max_bytes=1 << 20,
    ) as stream:
        assert stream.status == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [event["data"] for event in iter_sse(stream.chunks())]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
