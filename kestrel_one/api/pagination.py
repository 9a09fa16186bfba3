"""Cursor pagination ordered by public id (a time-ordered ULID), so no row number leaks."""

from django.core.exceptions import FieldDoesNotExist
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework.exceptions import NotFound
from rest_framework.pagination import CursorPagination

from kestrel_one.api.params import page_limit
from kestrel_one.common.errors import ValidationFailed

INVALID_CURSOR = (
    "cursor is not one this API handed out; follow the next and previous links as given, "
    "or leave cursor out to start at the first page."
)


class PublicIdCursorPagination(CursorPagination):
    ordering = "public_id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def get_page_size(self, request):
        """``limit`` clamped to 1..200; anything but a whole number is a 400 naming it.

        DRF would quietly use the default page size for ``limit=abc``, hiding the mistake.
        """
        return page_limit(request, default=self.page_size, maximum=self.max_page_size)

    def paginate_queryset(self, queryset, request, view=None):
        self._model = queryset.model  # what decode_cursor checks a position against
        return super().paginate_queryset(queryset, request, view)

    def decode_cursor(self, request):
        """The cursor, or a 400 naming it when it does not decode or its position is no value
        of the ordering field (the cursor is only base64: anyone can edit it). DRF answers a
        404 for the first, and the second reached the database: a 500."""
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            raise ValidationFailed(INVALID_CURSOR, details={"cursor": ["invalid"]}) from None
        if cursor is not None and cursor.position is not None:
            self._check_position(cursor.position)
        return cursor

    def _check_position(self, position: str) -> None:
        name = self.ordering[0].lstrip("-") if self.ordering else ""
        if "\x00" in position:
            raise ValidationFailed(INVALID_CURSOR, details={"cursor": ["invalid"]})
        model = getattr(self, "_model", None)
        if model is None or "__" in name:
            return
        try:
            model._meta.get_field(name).to_python(position)
        except FieldDoesNotExist:
            return
        except DjangoValidationError:
            raise ValidationFailed(INVALID_CURSOR, details={"cursor": ["invalid"]}) from None
