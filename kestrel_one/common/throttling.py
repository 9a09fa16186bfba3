"""Rate bounds every web process shares: DRF's ``SimpleRateThrottle`` counted in the
``KESTREL_RATE_CACHE`` cache (Redis) instead of each process's own."""

from __future__ import annotations

from django.conf import settings
from django.core.cache import caches
from rest_framework.throttling import SimpleRateThrottle


class SharedRateThrottle(SimpleRateThrottle):
    """At most the rate the setting ``rate_setting`` names (DRF's "N/second|minute|hour|
    day", read when a request is judged), per what ``get_cache_key`` counts."""

    rate_setting: str

    def __init__(self):
        self.cache = caches[settings.KESTREL_RATE_CACHE]
        super().__init__()

    def get_rate(self):
        return getattr(settings, self.rate_setting)
