"""Cursor pagination ordered by public id (a time-ordered ULID), so no row number leaks."""

from rest_framework.pagination import CursorPagination

from kestrel_one.common.errors import ValidationFailed


class PublicIdCursorPagination(CursorPagination):
    ordering = "public_id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def get_page_size(self, request):
        """``limit`` clamped to 1..200; anything but a whole number is a 400 naming it.

        DRF would quietly use the default page size for ``limit=abc``, hiding the mistake.
        """
        value = request.query_params.get(self.page_size_query_param)
        if value is None:
            return self.page_size
        if not (value.isascii() and value.isdigit()):
            raise ValidationFailed(
                "limit must be a whole number ≥ 0.", details={"limit": ["invalid"]}
            )
        return max(1, min(int(value), self.max_page_size))
