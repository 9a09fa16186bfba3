"""Cursor pagination ordered by public id (a time-ordered ULID), so no row number leaks."""

from rest_framework.pagination import CursorPagination

from kestrel_one.api.params import page_limit


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
