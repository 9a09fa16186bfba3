"""Serializer building blocks shared by every endpoint."""

from __future__ import annotations

from rest_framework import serializers

from kestrel_one.common.errors import echo


def list_choices(field: serializers.Field) -> None:
    """Make ``field``'s invalid-choice error (and any nested field's) name the allowed values.

    DRF says only '"x" is not a valid choice.'; a person then has to find the choices
    elsewhere. Applied once, to every field of every ``StrictSerializer``, so no field needs
    to remember it.
    """
    if isinstance(field, serializers.ChoiceField):
        allowed = ", ".join(field.choice_strings_to_values)
        # The message is a str.format template ({input}); braces in a choice stay literal.
        allowed = allowed.replace("{", "{{").replace("}", "}}")
        field.error_messages["invalid_choice"] = (
            f'"{{input}}" is not a valid choice; use one of: {allowed}.'
        )
    elif isinstance(field, serializers.ListField | serializers.DictField):
        list_choices(field.child)
    elif isinstance(field, serializers.ListSerializer):
        list_choices(field.child)
    elif isinstance(field, serializers.Serializer) and not isinstance(field, StrictSerializer):
        for child in field.fields.values():
            list_choices(child)


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know (or may not write) instead of silently dropping them.

    Its errors say what would be accepted: an unknown field lists the fields there are, an
    invalid choice lists the choices.
    """

    default_error_messages = {"invalid": "Expected a JSON object, but got {datatype}."}
    # What the names are, for messages; a serializer of query parameters says so.
    field_kind = "field"

    def get_fields(self):
        fields = super().get_fields()
        for field in fields.values():
            list_choices(field)
        return fields

    def to_internal_value(self, data):
        if isinstance(data, dict):
            writable = sorted(name for name, field in self.fields.items() if not field.read_only)
            unknown = sorted(set(data) - set(writable))
            if unknown:
                takes = ", ".join(writable) if writable else "none"
                kind = self.field_kind
                raise serializers.ValidationError(
                    {
                        name: [
                            f"{kind.capitalize()} '{echo(name)}' is read-only; "
                            f"the {kind}s you may send are: {takes}."
                            if name in self.fields
                            else f"Unknown {kind} '{echo(name)}'; the {kind}s are: {takes}."
                        ]
                        for name in unknown
                    }
                )
        return super().to_internal_value(data)


class StrictModelSerializer(StrictSerializer, serializers.ModelSerializer):
    pass


class PublicIdRelatedField(serializers.SlugRelatedField):
    """A related object named by its public id (``env_...``), found only in ``queryset``.

    The view narrows ``queryset`` to the caller's organization, so another organization's id
    gets exactly the message a missing one gets (TEN-4): "no environment env_... in this
    organization", with no internal field or lookup named.
    """

    def __init__(self, *, noun: str, prefix: str, within: str = "this organization", **kwargs):
        kwargs.setdefault("slug_field", "public_id")
        super().__init__(**kwargs)
        self.noun, self.prefix, self.within = noun, prefix, within

    def to_internal_value(self, data):
        if not isinstance(data, str) or not data:
            raise serializers.ValidationError(
                f"Must be the {self.noun}'s id, a string such as {self.prefix}_...",
                code="invalid",
            )
        found = self.get_queryset().filter(**{self.slug_field: data}).first()
        if found is None:
            raise serializers.ValidationError(
                f"no {self.noun} {echo(data)} in {self.within}", code="does_not_exist"
            )
        return found


class RedactedSerializer(serializers.ModelSerializer):
    """A model serializer whose free-form fields leave through the one redaction path.

    What is stored was redacted when it was received (kestrel_one.common.redaction); this is
    the second pass on the way out, so a rule added later also covers older rows (CRED-1).
    ``redacted_fields`` maps a field name to the redaction that applies to it.
    """

    redacted_fields: dict = {}

    def to_representation(self, instance):
        data = super().to_representation(instance)
        for name, redaction in self.redacted_fields.items():
            if name in data and data[name] is not None:
                data[name] = redaction(data[name])
        return data


def named_among(visible, ids: list[str], *, field: str, noun: str) -> list:
    """The objects ``ids`` names (public ids), looked up in ``visible``, the ones the caller
    can see: one it cannot see is answered exactly like a missing one. In the order given,
    once each."""
    found = {obj.public_id: obj for obj in visible.filter(public_id__in=ids)}
    missing = {f"{field}[{i}]": pid for i, pid in enumerate(ids) if pid not in found}
    if missing:
        raise serializers.ValidationError(
            {name: [f"no {noun} {echo(pid)} in this organization"] for name, pid in missing.items()}
        )
    return [found[pid] for pid in dict.fromkeys(ids)]
