"""Signed audit heads catch a rewritten tail that the hash chain alone cannot (AUD-1).

Someone with write access to the database rewrites the last records, recomputes every hash
after them and moves the chain head: the chain verifies. A head an auditor fetched earlier
(``GET /orgs/{org}/audit/head``, signed with the control plane's key, whose public half is
``GET /api/v1/keys``) does not: ``audit_verify --head FILE`` names the record that changed.
"""

from __future__ import annotations

import json
from io import StringIO

import jwt
import pytest
from django.core.management import call_command
from jwt.algorithms import OKPAlgorithm
from rest_framework.test import APIClient

from kestrel_one.audit.chain import HASHED_FIELDS, chain_hash
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.common.keys import control_public_key_pem, key_id
from runners.contract.tokens import generate_private_key_pem, load_public_key, public_key_pem
from tests.audit.helpers import append_records, tampering

pytestmark = pytest.mark.spec("AUD-1")

HEAD_URL = "/api/v1/orgs/acme/audit/head"
_STORED = tuple(name for name in HASHED_FIELDS if name != "organization")


def fetch_head(world, tmp_path, name="head.json") -> tuple[dict, object]:
    response = world["owner"].client().get(HEAD_URL)
    assert response.status_code == 200, response.content
    head = response.json()
    path = tmp_path / name
    path.write_text(json.dumps(head))
    return head, path


def verify(*args) -> tuple[int, str]:
    """``audit_verify`` in this process (it sees the test's transaction): (exit code, output)."""
    out, err = StringIO(), StringIO()
    try:
        call_command("audit_verify", *args, stdout=out, stderr=err)
    except SystemExit as exit_info:
        return int(exit_info.code), err.getvalue()
    return 0, out.getvalue()


def rewrite_tail(organization, start: int) -> None:
    """From record #start on: change each record, recompute its hash and link, and move the
    chain head to the new last hash, as an attacker with the database would."""
    rows = list(
        AuditRecord.objects.filter(organization=organization, sequence__gte=start)
        .order_by("sequence")
        .values("id", *_STORED)
    )
    previous = AuditRecord.objects.get(organization=organization, sequence=start - 1).hash
    with tampering():
        for row in rows:
            row["data"] = {**row["data"], "rewritten": True}
            row["prev_hash"] = previous
            row["hash"] = chain_hash(row, organization_public_id=organization.public_id)
            AuditRecord.objects.filter(pk=row["id"]).update(
                data=row["data"], prev_hash=row["prev_hash"], hash=row["hash"]
            )
            previous = row["hash"]
        AuditChain.objects.filter(organization=organization).update(last_hash=previous)


def test_keys_are_a_public_jwks_of_the_control_plane_key(db):
    response = APIClient().get("/api/v1/keys")
    assert response.status_code == 200
    [key] = response.json()["keys"]
    assert (key["kty"], key["crv"], key["alg"], key["use"]) == ("OKP", "Ed25519", "EdDSA", "sig")
    assert key["kid"] == key_id(key)
    assert "d" not in key  # the public half only
    served = jwt.PyJWK.from_dict(key).key
    assert served.public_bytes_raw() == load_public_key(control_public_key_pem()).public_bytes_raw()


def test_the_head_is_the_chain_head_signed_for_audit_readers(world, tmp_path):
    append_records(world.org, 4)
    head, _ = fetch_head(world, tmp_path)
    chain = AuditChain.objects.get(organization=world.org)
    assert (head["seq"], head["hash"]) == (chain.last_sequence, chain.last_hash)
    jwks = jwt.PyJWKSet.from_dict(APIClient().get("/api/v1/keys").json())
    kid = jwt.get_unverified_header(head["signature"])["kid"]
    claims = jwt.decode(head["signature"], jwks[kid].key, algorithms=["EdDSA"])
    assert claims == {"org": world.org.public_id, **{k: head[k] for k in ("seq", "hash", "at")}}
    # Whoever may not read the audit log may not read its head either.
    assert world["member"].client().get(HEAD_URL).status_code == 403
    assert world["outsider"].client().get(HEAD_URL).status_code == 404


def test_a_rewritten_tail_passes_the_chain_but_fails_the_kept_head(world, tmp_path):
    append_records(world.org, 10)
    head, path = fetch_head(world, tmp_path)
    kept = head["seq"]
    append_records(world.org, 3, start=10)  # the chain goes on after the auditor's copy
    code, output = verify("--org", "acme", "--head", str(path))
    assert code == 0 and f"record #{kept} matches" in output

    rewrite_tail(world.org, start=kept - 2)
    assert audit_chain_verify(world.org).ok, "the rewrite recomputed every hash"
    assert verify("--org", "acme")[0] == 0, "without a kept head it goes unnoticed"
    code, output = verify("--org", "acme", "--head", str(path))
    assert code == 1
    assert f"record #{kept} does not have the hash" in output and "BROKEN" in output


def test_a_head_that_was_not_signed_by_the_control_plane_is_refused(world, tmp_path):
    append_records(world.org, 3)
    head, path = fetch_head(world, tmp_path)
    forged_key = generate_private_key_pem()
    claims = {"org": world.org.public_id, "seq": 1, "hash": "0" * 64, "at": head["at"]}
    header = jwt.get_unverified_header(head["signature"])
    cases = {
        "edited seq": {**head, "seq": head["seq"] - 1},
        "edited hash": {**head, "hash": "0" * 64},
        "another key": {
            **head,
            "signature": jwt.encode(claims, forged_key, algorithm="EdDSA", headers=header),
        },
        "not a jws": {**head, "signature": "x"},
    }
    for name, forged in cases.items():
        path.write_text(json.dumps(forged))
        code, output = verify("--org", "acme", "--head", str(path))
        assert code == 1 and "does not verify" in output, (name, output)
    # Another organization's head is not this one's.
    path.write_text(json.dumps(head))
    append_records(world.other_org, 1)
    code, output = verify("--org", "globex", "--head", str(path))
    assert code == 1 and "not globex's" in output


def test_the_head_is_checked_against_the_keys_the_auditor_kept(world, tmp_path):
    append_records(world.org, 3)
    _, head_path = fetch_head(world, tmp_path)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(APIClient().get("/api/v1/keys").json()))
    assert verify("--org", "acme", "--head", str(head_path), "--keys", str(keys))[0] == 0
    # Keys that are not the ones that signed the head do not verify it.
    other = load_public_key(public_key_pem(generate_private_key_pem()))
    jwk = OKPAlgorithm.to_jwk(other, as_dict=True)
    keys.write_text(json.dumps({"keys": [{**jwk, "kid": key_id(jwk)}]}))
    code, output = verify("--org", "acme", "--head", str(head_path), "--keys", str(keys))
    assert code == 1 and "not one of the keys" in output
    # The same key under the head's kid, but another key's material, fails the signature.
    kid = jwt.get_unverified_header(json.loads(head_path.read_text())["signature"])["kid"]
    keys.write_text(json.dumps({"keys": [{**jwk, "kid": kid}]}))
    code, output = verify("--org", "acme", "--head", str(head_path), "--keys", str(keys))
    assert code == 1 and "does not verify against the keys" in output
