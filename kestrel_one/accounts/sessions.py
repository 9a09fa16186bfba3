"""Console sessions whose lifetime counts from sign-in, however often they are saved.

Django's database sessions set their expiry to ``SESSION_COOKIE_AGE`` from each save, so a
session that is written to (a sudo confirmation, a message shown on the next page) would
live on. Signing in stamps the session with its time (``SIGNED_IN_AT``) and this store never
lets a save move the expiry past that time plus ``SESSION_COOKIE_AGE``
(``KESTREL_SESSION_SECONDS``).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.contrib.sessions.backends import db
from django.dispatch import receiver

SIGNED_IN_AT = "kestrel_signed_in_at"


class SessionStore(db.SessionStore):
    def get_expiry_date(self, **kwargs) -> datetime:
        expiry = super().get_expiry_date(**kwargs)
        signed_in = self.get(SIGNED_IN_AT)
        if not isinstance(signed_in, float):
            return expiry
        return min(expiry, datetime.fromtimestamp(signed_in + settings.SESSION_COOKIE_AGE, UTC))


@receiver(user_logged_in)
def _stamp_sign_in(sender, request, user, **kwargs) -> None:
    if request is not None and hasattr(request, "session"):
        request.session[SIGNED_IN_AT] = time.time()
