"""gunicorn's access log with secrets in request lines masked.

gunicorn writes its access log itself, outside Django's logging and its redaction. Share
links carry their token in the URL path, and a careless client may put a token in a query
string, so the request line, path, query and referer go through the one redaction module.
"""

from __future__ import annotations

from gunicorn.glogging import Logger

from kestrel_one.common.redaction import redact_text

# r: request line, U: path, q: query string, f: referer.
_URL_ATOMS = ("r", "U", "q", "f")


class RedactingAccessLogger(Logger):
    def atoms(self, resp, req, environ, request_time):
        atoms = super().atoms(resp, req, environ, request_time)
        for name in _URL_ATOMS:
            if isinstance(atoms.get(name), str):
                atoms[name] = redact_text(atoms[name])
        return atoms
