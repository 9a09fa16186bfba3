"""The API's one filter backend: django-filter, with errors that name the allowed values."""

from __future__ import annotations

from django import forms
from django_filters.rest_framework import DjangoFilterBackend


class FilterBackend(DjangoFilterBackend):
    """``?state=yolo`` is a 400 saying which states there are, not "Select a valid choice"."""

    def get_filterset(self, request, queryset, view):
        filterset = super().get_filterset(request, queryset, view)
        if filterset is not None:
            for field in filterset.form.fields.values():
                list_form_choices(field)
        return filterset


def list_form_choices(field: forms.Field) -> None:
    # A model choice field's choices are a query; the filters here take fixed values only.
    if isinstance(field, forms.ChoiceField) and not isinstance(field, forms.ModelChoiceField):
        allowed = ", ".join(str(value) for value, _ in _flat(field.choices) if value != "")
        # Django formats the message with %-style parameters; a literal % is doubled.
        field.error_messages["invalid_choice"] = (
            "%(value)s is not one of the choices: " + allowed.replace("%", "%%") + "."
        )


def _flat(choices):
    for value, label in choices:
        if isinstance(label, list | tuple):  # a named group of choices
            yield from _flat(label)
        else:
            yield value, label
