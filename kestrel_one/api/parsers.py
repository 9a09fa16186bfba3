"""The API's one request parser."""

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, but a body nested deeper than Python's decoder goes is a 400.

    The decoder raises RecursionError there, which DRF does not catch: a few kilobytes of
    ``[[[[...`` would otherwise be a server error.
    """

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the document is nested too deeply.") from None
