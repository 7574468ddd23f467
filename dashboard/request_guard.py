"""What no request may carry past the door, and the answer it gets instead of a 500: a clear 4xx sentence (JSON under
/api/, a short page elsewhere), nothing changed, one line in the log.

- NUL anywhere in the path, the query or a form's fields (PostgreSQL stores no NUL in text), and text that is not
  valid Unicode (a lone surrogate cannot be stored either);
- a body larger than Django's limit (``DATA_UPLOAD_MAX_MEMORY_SIZE``);
- in a JSON body (``strict_json``): NaN, Infinity or a number too large for a float, an object or list nested deeper
  than MAX_DEPTH, and the same NUL and surrogates in any name or string.

A database that refuses the connection (full, restarting) answers 503 with ``Retry-After`` rather than a traceback.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.db import DataError, InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

log = logging.getLogger(__name__)

MAX_DEPTH = 64  # the deepest a JSON body may nest objects and lists (a job's spec needs five)
RETRY_AFTER_SECONDS = 5  # what a 503 asks a client to wait when the database refuses a connection


class Refused(ValueError):
    """A request refused at the door: ``status`` and a sentence for whoever sent it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def text_problem(value: str) -> str:
    """What makes ``value`` unstorable ('' when nothing does): a NUL, or a lone surrogate."""
    if "\x00" in value:
        return "holds a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    return ""


def _no_constants(name: str) -> Any:
    raise Refused(400, f"The body holds {name}, which JSON does not allow: send a number or null.")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise Refused(400, f"The body holds the number {text[:40]}, too large for a float.")
    return number


def strict_json(body: bytes) -> Any:
    """The JSON document ``body``, refused (``Refused``, 400) as the module's note says."""
    try:
        data = json.loads(body, parse_constant=_no_constants, parse_float=_finite)
    except Refused:
        raise
    except RecursionError:
        raise Refused(400, f"The body is nested deeper than {MAX_DEPTH} levels.") from None
    except (ValueError, UnicodeDecodeError):
        raise Refused(400, "The body must be JSON.") from None
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:  # by hand, not recursion: the depth is what is being checked
        value, depth = stack.pop()
        if isinstance(value, str):
            if problem := text_problem(value):
                raise Refused(400, f"A string in the body {problem}.")
        elif isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise Refused(400, f"The body is nested deeper than {MAX_DEPTH} levels.")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
    return data


def refused_response(request: HttpRequest, status: int, message: str, **headers: str) -> HttpResponse:
    """The answer to a refused request: JSON under /api/, a short plain page elsewhere; one line in the log."""
    log.warning("refused %s %s: %s %s", request.method, request.path[:200].encode("unicode_escape").decode(), status,
                message)  # fmt: skip
    if request.path.startswith("/api/"):
        response: HttpResponse = JsonResponse({"error": message}, status=status)
    else:
        response = HttpResponse(message + "\n", status=status, content_type="text/plain; charset=utf-8")
    for name, value in headers.items():
        response[name] = value
    response._has_been_logged = True  # type: ignore[attr-defined]  # the line above is its one line: not Django's too
    return response


class RequestGuard:
    """The middleware: refuses what the module's note lists before any view or session reads it, and turns the
    database's refusals into 503 (or 400 for text it will not store) instead of a 500."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            self._check(request)
        except Refused as exc:
            return refused_response(request, exc.status, str(exc))
        return self.get_response(request)

    def _check(self, request: HttpRequest) -> None:
        if problem := text_problem(request.path):
            raise Refused(400, f"The path {problem}.")
        try:
            fields = [*request.GET.lists()]
            if request.method == "POST" and request.content_type in (
                "application/x-www-form-urlencoded",
                "multipart/form-data",
            ):
                fields += [*request.POST.lists()]
        except RequestDataTooBig:
            raise Refused(413, "The body is larger than the console accepts.") from None
        except TooManyFieldsSent:
            raise Refused(400, "The request has more fields than the console accepts.") from None
        for name, values in fields:
            for text in (name, *values):
                if problem := text_problem(text):
                    raise Refused(400, f"The field {name[:40].encode('unicode_escape').decode()!r} {problem}.")

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if isinstance(exc, RequestDataTooBig):
            return refused_response(request, 413, "The body is larger than the console accepts.")
        if isinstance(exc, OperationalError | InterfaceError):
            return refused_response(
                request, 503, "The database is not answering (full or restarting); try again shortly.",
                **{"Retry-After": str(RETRY_AFTER_SECONDS)},
            )  # fmt: skip
        if isinstance(exc, DataError):
            return refused_response(request, 400, "The request holds a value the database cannot store.")
        return None
