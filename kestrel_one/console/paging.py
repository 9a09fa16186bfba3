"""Pages of a list that stay fast however long the list is.

Django's ``Paginator`` counts every row to number the pages: on an organization with a
hundred thousand actions or audit records that count alone costs more than the page. The
console's lists count at most ``LIST_LIMIT`` rows (``SELECT COUNT(*)`` over a ``LIMIT``
subquery, an index range at most that long) and number the pages up to there; past it, the
page says "1,000+" and the person narrows the list with its filters (the audit log's time
range, for one) instead of paging through it.
"""

from __future__ import annotations

from functools import cached_property

from django.core.paginator import Paginator

# The most rows a console list counts and pages through.
LIST_LIMIT = 1000


class BoundedPaginator(Paginator):
    """A ``Paginator`` over at most ``limit`` rows of ``object_list`` (ordered)."""

    def __init__(self, object_list, per_page, *, limit: int = LIST_LIMIT, **kwargs):
        super().__init__(object_list, per_page, **kwargs)
        self.limit = limit

    @cached_property
    def seen(self) -> int:
        """Rows counted, at most ``limit + 1`` (one more says there are more)."""
        return self.object_list[: self.limit + 1].count()

    @cached_property
    def count(self) -> int:
        return min(self.seen, self.limit)

    @property
    def capped(self) -> bool:
        return self.seen > self.limit

    @property
    def count_label(self) -> str:
        return f"{self.count:,}+" if self.capped else f"{self.count:,}"

    @property
    def num_pages_label(self) -> str:
        return f"{self.num_pages}+" if self.capped else str(self.num_pages)


def page_of(queryset, number, *, per_page: int, limit: int = LIST_LIMIT):
    """One page of ``queryset`` (already ordered); an unknown page number is the last."""
    return BoundedPaginator(queryset, per_page, limit=limit).get_page(number)


def capped_count(queryset, *, limit: int = 99) -> tuple[int, str]:
    """(count up to ``limit + 1``, its label: "99+" past the limit), for counts in the
    navigation and summaries that must not cost a full count."""
    seen = queryset[: limit + 1].count()
    return min(seen, limit + 1), (f"{limit}+" if seen > limit else str(seen))
