"""Cursor pagination ordered by public id (a time-ordered ULID), so no row number leaks."""

from rest_framework.pagination import CursorPagination


class PublicIdCursorPagination(CursorPagination):
    ordering = "public_id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200
