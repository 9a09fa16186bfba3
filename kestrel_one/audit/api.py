"""``GET /api/v1/orgs/{org}/audit``: the organization's audit log, newest first; and
``GET /api/v1/orgs/{org}/audit/head``: its chain head, signed, for an auditor to keep.

Readable by owners, admins and auditors (scope ``audit:read``). Items are projections: the
stored data is redacted and bounded again on the way out (redaction rules only ever grow,
so older rows get today's rules), and ``sequence``, ``prev_hash`` and ``hash`` are included
because they are not secret and let a reader check the chain for themselves. Records
committed but not yet chained are chained before the page is read, so none is missing.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers
from rest_framework.response import Response

from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.api.pagination import PublicIdCursorPagination
from kestrel_one.api.serializers import StrictSerializer
from kestrel_one.audit.heads import audit_head_sign
from kestrel_one.audit.models import AuditChain, AuditRecord
from kestrel_one.audit.selectors import audit_records_chained, audit_records_filter
from kestrel_one.audit.services import audit_chain_settle
from kestrel_one.common.redaction import bounded, redact_text

AUDIT_PROJECTION_MAX_BYTES = 4096
PAGINATION_PARAMS = {"cursor", "limit"}


class AuditCursorPagination(PublicIdCursorPagination):
    """Newest first by chain sequence, which is unique within the (always filtered) org."""

    ordering = "-sequence"


class AuditRecordSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    actor = serializers.SerializerMethodField()
    target = serializers.SerializerMethodField()
    data = serializers.SerializerMethodField()

    class Meta:
        model = AuditRecord
        fields = [
            "id",
            "sequence",
            "created_at",
            "actor",
            "action",
            "target",
            "outcome",
            "data",
            "request_id",
            "source_address",
            "prev_hash",
            "hash",
        ]
        read_only_fields = fields

    def get_actor(self, record) -> dict:
        return {"type": record.actor_type, "id": redact_text(record.actor_id)}

    def get_target(self, record) -> dict | None:
        if not record.target_type and not record.target_id:
            return None
        return {"type": record.target_type, "id": record.target_id}

    def get_data(self, record) -> dict:
        return bounded(record.data, max_bytes=AUDIT_PROJECTION_MAX_BYTES)


class AuditQuerySerializer(StrictSerializer):
    field_kind = "query parameter"

    actor = serializers.CharField(required=False, max_length=64, help_text="An actor id.")
    action = serializers.CharField(
        required=False, max_length=64, help_text="An action, or a family such as 'token.*'."
    )
    target = serializers.CharField(required=False, max_length=64, help_text="A target id.")
    outcome = serializers.CharField(
        required=False, max_length=16, help_text="success, refused, or a service's own outcome."
    )
    since = serializers.DateTimeField(required=False, help_text="ISO 8601, inclusive.")
    until = serializers.DateTimeField(required=False, help_text="ISO 8601, exclusive.")

    def validate(self, attrs):
        since, until = attrs.get("since"), attrs.get("until")
        if since and until and since >= until:
            raise serializers.ValidationError({"until": ["Must be after since."]})
        return attrs


@extend_schema(
    parameters=[
        OpenApiParameter(name, str, description=str(field.help_text or ""))
        for name, field in AuditQuerySerializer().fields.items()
    ]
)
class AuditRecordViewSet(mixins.ListModelMixin, OrgScopedViewSet):
    """The organization's audit records; filters narrow, unknown query parameters are a 400."""

    scope_map = {"GET": "audit:read"}
    queryset = AuditRecord.objects.none()
    serializer_class = AuditRecordSerializer
    pagination_class = AuditCursorPagination
    filter_backends: list = []

    def restrict(self, queryset):
        # Records still waiting to be chained have no sequence yet; ``list`` chains them first.
        return audit_records_chained(self.organization)

    def list(self, request, *args, **kwargs):
        audit_chain_settle(self.organization)
        return super().list(request, *args, **kwargs)

    def filter_queryset(self, queryset):
        # A blank filter (``?actor=``, what an empty form field sends) filters nothing.
        params = {
            key: value
            for key, value in self.request.query_params.items()
            if key not in PAGINATION_PARAMS and value != ""
        }
        query = AuditQuerySerializer(data=params)
        query.is_valid(raise_exception=True)
        return audit_records_filter(queryset, **query.validated_data)


class AuditHeadSerializer(serializers.Serializer):
    seq = serializers.IntegerField(help_text="The sequence of the chain's last record.")
    hash = serializers.CharField(help_text="That record's hash (SHA-256, hex).")
    at = serializers.DateTimeField(help_text="When the head was signed.")
    signature = serializers.CharField(
        help_text="Compact JWS (EdDSA) over the organization's id, seq, hash and at; its "
        "kid names the key in GET /api/v1/keys."
    )


class AuditHeadViewSet(OrgScopedViewSet):
    """The chain head now, signed with the control plane's key (who may read the audit log).

    Keep it: ``manage.py audit_verify --org SLUG --head FILE`` later proves the records up to
    it were not rewritten, even by someone who recomputed every hash after them.
    """

    scope_map = {"GET": "audit:read"}
    queryset = AuditChain.objects.none()

    @extend_schema(responses={200: AuditHeadSerializer})
    def retrieve(self, request, *args, **kwargs):
        audit_chain_settle(self.organization)  # what is committed is in the head
        return Response(audit_head_sign(self.organization))
