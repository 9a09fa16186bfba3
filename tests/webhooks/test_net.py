"""Outbound safety: refused ranges, https only, the checked address is the one connected to,
redirects are never followed, answers are read only so far."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from kestrel_one.webhooks import net
from tests.test_settings import HOSTED, run_manage
from tests.webhooks.conftest import TEST_HOST

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("10.0.0.1", "private"),
    ("169.254.169.254", "link-local"),
    ("100.64.0.1", "CGNAT"),
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:169.254.169.254", "link-local"),
    ("::1", "loopback"),
    ("0.0.0.0", "unspecified"),  # noqa: S104 (an address to refuse, not one to bind)
    ("224.0.0.1", "multicast"),
    ("192.168.1.1", "private"),
    ("172.16.0.1", "private"),
    ("fd00::1", "private"),
    ("fe80::1", "link-local"),
    ("240.0.0.1", "reserved"),
    ("2002:7f00:1::", "loopback"),  # 6to4 carrying 127.0.0.1
    ("64:ff9b::a00:1", "private"),  # NAT64 carrying 10.0.0.1
]


def _resolving_to(monkeypatch, mapping: dict[str, list[str]], calls: list | None = None):
    real_getaddrinfo = socket.getaddrinfo

    def fake_getaddrinfo(host, port, *args, **kwargs):
        if host not in mapping:  # an address literal (urllib3 connecting): no lookup happens
            ipaddress.ip_address(host)
            return real_getaddrinfo(host, port, *args, **kwargs)
        if calls is not None:
            calls.append(host)
        return [(None, None, None, "", (address, port)) for address in mapping[host]]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)


@pytest.mark.spec("API-5")
@pytest.mark.parametrize(("address", "why"), REFUSED)
def test_refused_ranges(address, why):
    reason = net.address_refusal(ipaddress.ip_address(address))
    assert reason is not None and why in reason, reason


@pytest.mark.spec("API-5")
@pytest.mark.parametrize(
    "address", ["127.0.0.1", "10.0.0.1", "169.254.169.254", "100.64.0.1", "::ffff:127.0.0.1"]
)
def test_a_name_resolving_to_a_refused_address_is_refused_unless_allowlisted(
    monkeypatch, settings, address
):
    _resolving_to(monkeypatch, {"evil.example.com": [address]})
    destination = net.destination_parse("https://evil.example.com/hook")
    with pytest.raises(net.DestinationRefused) as refused:
        net.destination_addresses(destination)
    # What the endpoint's owner reads (``last_error``) names the host, never what it resolves
    # to: a tenant learns no internal address by pointing a webhook at a name.
    assert str(refused.value).startswith("evil.example.com resolves to an address that is ")
    assert str(ipaddress.ip_address(address)) not in str(refused.value)

    allowed = "127.0.0.1" if address.startswith("::ffff:") else address
    settings.KESTREL_WEBHOOK_ALLOW_ADDRESSES = [f"{allowed}/32"]
    settings.KESTREL_EGRESS_OVERRIDES_IN_HOSTED = True  # the tests run in hosted mode
    assert net.destination_addresses(destination) == [ipaddress.ip_address(address)]


def test_one_refused_answer_among_public_ones_refuses_the_name(monkeypatch):
    _resolving_to(monkeypatch, {"mixed.example.com": ["93.184.215.14", "10.0.0.1"]})
    with pytest.raises(net.DestinationRefused, match=r"^mixed\.example\.com .* private$"):
        net.destination_addresses(net.destination_parse("https://mixed.example.com/"))


def test_public_addresses_pass():
    assert net.address_refusal(ipaddress.ip_address("93.184.215.14")) is None
    assert (
        net.address_refusal(ipaddress.ip_address("2606:2800:21f:cb07:6820:80da:af6b:8b2c")) is None
    )


@pytest.mark.spec("API-5")
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://hooks.example.com/", "https"),
        ("ftp://hooks.example.com/", "https"),
        ("https://user:pw@hooks.example.com/", "credentials"),
        ("https:///nohost", "no host"),
        ("https://10.0.0.1/", "private"),
        ("https://[::ffff:127.0.0.1]/", "loopback"),
        ("https://169.254.169.254/latest/meta-data", "link-local"),
        ("https://hooks.example.com:99999/", "valid URL"),
    ],
)
def test_url_form_is_checked_in_hosted_mode(url, message):
    with pytest.raises(net.DestinationRefused, match=message):
        net.destination_parse(url)


def test_plain_http_is_accepted_only_outside_hosted_mode(settings):
    settings.HOSTED = False
    assert net.destination_parse("http://hooks.example.com/x?a=1").target == "/x?a=1"


@pytest.mark.spec("API-5")
def test_connects_to_the_checked_address_with_the_names_host_sni_and_certificate(
    monkeypatch, webhook_settings, consumer_thread
):
    """The name resolves once; the request reaches the checked address and still verifies
    TLS for the name (the certificate is issued for TEST_HOST, not for an address)."""
    calls: list[str] = []
    _resolving_to(monkeypatch, {TEST_HOST: ["127.0.0.1"]}, calls)
    answer = net.post(
        consumer_thread.url("/ok/pinned", host=TEST_HOST), body=b"{}", headers={"x-test": "1"}
    )
    assert answer.status == 204
    assert calls == [TEST_HOST]  # resolved exactly once: no second lookup before connecting
    (received,) = consumer_thread.received()
    assert received["headers"]["host"] == f"{TEST_HOST}:{consumer_thread.port}"


def test_a_certificate_for_another_name_fails(monkeypatch, webhook_settings, consumer_thread):
    _resolving_to(monkeypatch, {"other.kestrel.test": ["127.0.0.1"]})
    with pytest.raises(net.SendFailed):
        net.post(consumer_thread.url("/ok/x", host="other.kestrel.test"), body=b"{}", headers={})
    assert consumer_thread.received() == []


@pytest.mark.spec("API-5")
def test_a_redirect_is_answered_but_never_followed(webhook_settings, consumer_thread):
    answer = net.post(consumer_thread.url("/redirect/x"), body=b"{}", headers={})
    assert answer.status == 302
    assert [r["path"] for r in consumer_thread.received()] == ["/redirect/x"]


def test_loopback_is_refused_without_the_allowlist(webhook_settings, consumer_thread):
    webhook_settings.KESTREL_WEBHOOK_ALLOW_ADDRESSES = []
    with pytest.raises(net.DestinationRefused, match="loopback"):
        net.post(consumer_thread.url("/ok/x"), body=b"{}", headers={})
    assert consumer_thread.received() == []


@pytest.mark.spec("API-5")
def test_the_development_allowlist_admits_nothing_in_hosted_mode_unless_enabled(
    monkeypatch, settings
):
    """``KESTREL_WEBHOOK_ALLOW_ADDRESSES`` opens refused ranges to URLs that tenants choose:
    in hosted mode it counts only beside the operator's explicit switch for development
    settings (KESTREL_EGRESS_OVERRIDES_IN_HOSTED), like the egress overrides."""
    _resolving_to(monkeypatch, {"evil.example.com": ["10.1.2.3"]})
    destination = net.destination_parse("https://evil.example.com/hook")
    settings.KESTREL_WEBHOOK_ALLOW_ADDRESSES = ["10.0.0.0/8"]
    settings.HOSTED, settings.KESTREL_EGRESS_OVERRIDES_IN_HOSTED = True, False
    with pytest.raises(net.DestinationRefused, match="private"):
        net.destination_addresses(destination)
    with pytest.raises(net.DestinationRefused, match="private"):
        net.destination_parse("https://10.1.2.3/hook")

    settings.KESTREL_EGRESS_OVERRIDES_IN_HOSTED = True
    assert net.destination_addresses(destination) == [ipaddress.ip_address("10.1.2.3")]
    settings.HOSTED, settings.KESTREL_EGRESS_OVERRIDES_IN_HOSTED = False, False
    assert net.destination_addresses(destination) == [ipaddress.ip_address("10.1.2.3")]


def test_hosted_startup_refuses_the_webhook_allowlist_unless_explicitly_enabled():
    variable = "KESTREL_WEBHOOK_ALLOW_ADDRESSES"
    refused = run_manage({**HOSTED, variable: "10.0.0.0/8"}, "check")
    assert refused.returncode != 0
    assert f"{variable} is refused in hosted mode" in refused.stderr
    enabled = run_manage(
        {**HOSTED, variable: "10.0.0.0/8", "KESTREL_EGRESS_OVERRIDES_IN_HOSTED": "1"}, "check"
    )
    assert enabled.returncode == 0, enabled.stderr[-2000:]
