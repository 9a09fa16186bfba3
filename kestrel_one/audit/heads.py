"""Signed audit chain heads: what lets an auditor catch a rewritten tail (AUD-1).

The hash chain alone has no key: someone who can write the database can rewrite the last
records, recompute every hash after them and move the chain head, and the chain verifies
again. A head signed with the control plane's key (``kestrel_one.common.keys``) and kept
outside the database pins the chain: the record at that sequence must still have that hash,
and no one without the key can sign a head for a rewritten chain.

A head is ``{"seq", "hash", "at", "signature"}``: ``signature`` is a compact JWS (EdDSA,
through PyJWT) whose payload repeats the organization, ``seq``, ``hash`` and ``at`` (when it
was signed); the JWS header's ``kid`` names the key in ``GET /api/v1/keys``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt
import jwt.exceptions
from django.utils import timezone

from kestrel_one.audit.chain import GENESIS_HASH, canonical_json
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.common.keys import ALGORITHM, control_jwks, control_private_key

HEAD_TYP = "kestrel-audit-head+jwt"
HEAD_CLAIMS = frozenset({"org", "seq", "hash", "at"})
HEAD_FIELDS = ("seq", "hash", "at")
# A head file is a small JSON object; anything far larger is not one.
HEAD_MAX_BYTES = 16 * 1024


class HeadRefused(Exception):
    """A head that does not verify: bad signature, unknown key, or not this organization's."""


def audit_head_sign(organization) -> dict[str, Any]:
    """The organization's chain head now, signed. The caller settles pending records first."""
    head = AuditChain.objects.filter(organization=organization).first()
    claims = {
        "org": organization.public_id,
        "seq": head.last_sequence if head else 0,
        "hash": head.last_hash if head else GENESIS_HASH,
        "at": timezone.now().isoformat(),
    }
    jwk = control_jwks()["keys"][0]
    signature = jwt.api_jws.PyJWS().encode(
        canonical_json(claims).encode(),
        control_private_key(),
        algorithm=ALGORITHM,
        headers={"typ": HEAD_TYP, "kid": jwk["kid"]},
    )
    return {
        "seq": claims["seq"],
        "hash": claims["hash"],
        "at": claims["at"],
        "signature": signature,
    }


def verified_head_claims(head: Any, *, organization, jwks: Mapping | None = None) -> dict:
    """The signed claims of a head, once its signature checks out against ``jwks`` (the
    control plane's own keys by default) and it names this organization and matches the
    fields it came with; :class:`HeadRefused` otherwise."""
    if not isinstance(head, Mapping) or not isinstance(head.get("signature"), str):
        raise HeadRefused('a head is a JSON object with "seq", "hash", "at" and "signature"')
    token = head["signature"]
    try:
        header = jwt.get_unverified_header(token)
    except jwt.exceptions.PyJWTError as error:
        raise HeadRefused(f"the signature is not a compact JWS: {error}") from None
    # Decided before any key is used: only EdDSA, never "none" or an HMAC fed a public key.
    if header.get("alg") != ALGORITHM or header.get("typ") != HEAD_TYP:
        raise HeadRefused(f"the signature is not an {ALGORITHM} audit head")
    try:
        keys = jwt.PyJWKSet.from_dict(dict(jwks or control_jwks()))
        key = keys[str(header.get("kid"))]
    except (jwt.exceptions.PyJWKSetError, KeyError):
        kid = header.get("kid")
        raise HeadRefused(f"the head was signed by key {kid!r}, not one of the keys") from None
    try:
        verified = jwt.api_jws.PyJWS().decode_complete(token, key.key, algorithms=[ALGORITHM])
        claims = json.loads(verified["payload"])
    except (jwt.exceptions.PyJWTError, ValueError):
        raise HeadRefused("the signature does not verify against the keys") from None
    if not isinstance(claims, dict) or set(claims) != HEAD_CLAIMS:
        raise HeadRefused(f"the signed payload must hold exactly {sorted(HEAD_CLAIMS)}")
    if claims["org"] != organization.public_id:
        raise HeadRefused(f"the head is {claims['org']}'s, not {organization.slug}'s")
    if any(head.get(name) != claims[name] for name in HEAD_FIELDS):
        raise HeadRefused("the head's seq, hash or at differ from what was signed")
    if not isinstance(claims["seq"], int) or claims["seq"] < 0:
        raise HeadRefused("the signed seq is not a sequence number")
    return claims


@dataclass(frozen=True)
class HeadCheck:
    """Whether the stored chain still holds a head an auditor kept."""

    ok: bool
    sequence: int | None
    message: str


def audit_head_check(organization, head: Any, *, jwks: Mapping | None = None) -> HeadCheck:
    """Check the stored chain against a signed head: the record at the head's ``seq`` must
    still carry the head's ``hash``. Run with :func:`audit_chain_verify`, which checks that
    every later record links back to it."""
    try:
        claims = verified_head_claims(head, organization=organization, jwks=jwks)
    except HeadRefused as refused:
        return HeadCheck(False, None, f"the kept head does not verify: {refused}")
    sequence, expected = claims["seq"], claims["hash"]
    chain = AuditChain.objects.filter(organization=organization).first()
    anchor = chain.anchor_sequence if chain else 0
    last = chain.last_sequence if chain else 0
    kept = f"the head signed at {claims['at']}"
    if sequence > last:
        return HeadCheck(
            False,
            sequence,
            f"the chain ends at #{last}, before #{sequence} of {kept} "
            "(records were removed from the end)",
        )
    if sequence == anchor:
        found = chain.anchor_hash if chain else GENESIS_HASH
    elif sequence < anchor:
        return HeadCheck(
            False,
            sequence,
            f"record #{sequence} of {kept} was trimmed by retention (the chain now starts "
            f"after #{anchor}); check against a newer head",
        )
    else:
        found = (
            AuditRecord.objects.filter(organization=organization, sequence=sequence)
            .values_list("hash", flat=True)
            .first()
        )
    if found != expected:
        return HeadCheck(
            False,
            sequence,
            f"record #{sequence} does not have the hash of {kept} "
            "(it, or a record before it, was rewritten)",
        )
    return HeadCheck(True, sequence, f"record #{sequence} matches {kept}")


__all__ = [
    "HeadCheck",
    "HeadRefused",
    "audit_head_check",
    "audit_head_sign",
    "verified_head_claims",
]
