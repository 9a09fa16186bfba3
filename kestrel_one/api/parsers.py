"""The API's one request parser."""

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, but a body nested deeper than Python's decoder goes is a 400, and a
    malformed body is told where the decoder stopped and what to send instead.

    The decoder raises RecursionError there, which DRF does not catch: a few kilobytes of
    ``[[[[...`` would otherwise be a server error.
    """

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("The request body's JSON is nested too deeply.") from None
        except ParseError as error:
            # DRF's text is "JSON parse error - <where the decoder stopped>"; keep the where.
            where = str(error.detail).removeprefix("JSON parse error - ")
            raise ParseError(
                f"The request body is not valid JSON ({where}); send one JSON object, "
                'such as {"name": "..."}.'
            ) from None
