"""What every route of the farm's HTTP API shares: the ``@route`` that declares one handler per
route, the errors a handler raises and the answers they become, the user a request acts as, and
the reading of a request's body with its limits.

A route's refusal is a 4xx with a JSON body naming what to change: ``{"error": "..."}`` on the
farm's own routes, OpenAI's ``{"error": {"message", "type", "param", "code"}}`` under ``/v1``.
Anything else a handler raises is the farm's bug: a 500 with an id that ``farm.log`` has the
traceback of, never the traceback itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from pan2render.runner.farm.users import User

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
F = TypeVar("F", bound=Callable[..., Awaitable[web.StreamResponse]])

JSON_BODY_MAX = 1 << 20  # a JSON body larger than this is refused (413): a batch's text rides in one too
JSON_DEPTH_MAX = 64  # lists and mappings nested deeper are refused, as in a batch file


def route(method: str, path: str) -> Callable[[F], F]:
    """Declare a method of a routes class as the handler of ``method path``."""
    def mark(fn: F) -> F:
        fn.__route__ = (method, path)  # type: ignore[attr-defined]
        return fn
    return mark


def routes_of(obj: object) -> list[web.RouteDef]:
    """The routes an object's ``@route`` methods declare, bound to it."""
    out = []
    for name in dir(type(obj)):
        fn = getattr(type(obj), name)
        if callable(fn) and hasattr(fn, "__route__"):
            method, path = fn.__route__
            out.append(web.route(method, path, getattr(obj, name)))
    return out


class ApiError(Exception):
    """A refusal: its HTTP status, the message, and (for OpenAI's shape) the parameter it concerns
    and a machine-readable code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error",
          503: "service_unavailable", 507: "insufficient_storage"}


def error_answer(request: web.Request, e: ApiError) -> web.Response:
    if request.path.startswith("/v1/"):
        body: dict[str, Any] = {"error": {"message": e.message, "type": _TYPES.get(e.status, "server_error"),
                                          "param": e.param, "code": e.code}}
    else:
        body = {"error": e.message}
    body.update(e.extra)
    return web.json_response(body, status=e.status)


USER = web.RequestKey("user", User)  # the user the request's token names, set by the API's authentication


def user_of(request: web.Request) -> User:
    return request[USER]


def too_deep(value: Any, limit: int = JSON_DEPTH_MAX) -> bool:
    """Is ``value`` (parsed JSON) nested deeper than ``limit``? Iterative: no recursion to exhaust."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


async def json_body(request: web.Request, *, required: bool = True) -> dict[str, Any]:
    """The request's JSON object; 400 naming what is wrong, 413 when too large."""
    if not request.can_read_body:
        if required:
            raise ApiError(400, "the body must be a JSON object")
        return {}
    if request.content_length is not None and request.content_length > JSON_BODY_MAX:
        raise ApiError(413, f"the body is {request.content_length} bytes; at most {JSON_BODY_MAX} are read")
    raw = await request.content.read(JSON_BODY_MAX + 1)
    if len(raw) > JSON_BODY_MAX:
        raise ApiError(413, f"the body is larger than {JSON_BODY_MAX} bytes")
    return parse_json_object(raw)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        data = json.loads(raw, parse_constant=constant)
    except RecursionError:
        raise ApiError(400, f"the body is nested too deep (at most {JSON_DEPTH_MAX} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(data).__name__}")
    if too_deep(data):
        raise ApiError(400, f"the body is nested too deep (at most {JSON_DEPTH_MAX} levels)")
    return data


def field(data: dict[str, Any], name: str, kind: type, *, default: Any = None, required: bool = False) -> Any:
    """``data[name]`` if it is exactly of ``kind`` (a bool is no int, an int no float unless float is
    asked), else 400 naming the field."""
    if name not in data or data[name] is None:
        if required:
            raise ApiError(400, f"{name!r} is required", param=name)
        return default
    value = data[name]
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind or (kind is float and not math.isfinite(value)):
        raise ApiError(400, f"{name!r} must be {_kind_name(kind)}, not {json.dumps(value)[:60]}", param=name)
    return value


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
            dict: "an object"}.get(kind, kind.__name__)
