"""The one error type of rollbus: ``ControlError(code, message)``.

``code`` is an HTTP status and travels unchanged from a worker rank to the engine, the
API and the HTTP response (the control reply's ``error_code``).
"""

from __future__ import annotations

from typing import Any

OK = 200
BAD_REQUEST = 400
UNAUTHORIZED = 401
FORBIDDEN = 403
NOT_FOUND = 404
CONFLICT = 409
UNPROCESSABLE = 422
TOO_MANY_REQUESTS = 429
INTERNAL = 500
NOT_IMPLEMENTED = 501
UNAVAILABLE = 503


class ControlError(Exception):
    """A control operation failed with an HTTP-like ``code`` and a message naming why."""

    def __init__(self, code: int, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.result = result

    def __repr__(self) -> str:
        return f"ControlError({self.code}, {self.message!r})"


class BusUnreachable(ControlError):
    """The NATS server named by the URL could not be reached."""

    def __init__(self, url: str, detail: str = "") -> None:
        from shared.redact import public_url  # never the URL's credentials

        extra = f" ({detail})" if detail else ""
        super().__init__(UNAVAILABLE, f"cannot reach NATS at {public_url(url)}{extra}")
        self.url = url


class Timeout(ControlError):
    def __init__(
        self, subject: str, timeout: float, missing: list[int] | None = None, lost: bool = False
    ) -> None:
        msg = f"no reply on {subject} within {timeout:g}s"
        if missing:
            msg = f"ranks {missing} did not answer on {subject} within {timeout:g}s"
        if lost:  # a scatter cut short by a lost NATS connection
            msg = f"ranks {missing} did not answer on {subject}: {LOST}"
        super().__init__(UNAVAILABLE, msg, {"missing_ranks": missing} if missing else None)
        self.missing = missing or []
        self.timeout = timeout
        self.lost = lost


LOST = "the NATS connection was lost while waiting (the call may have run)"


class ConnectionLost(ControlError):
    """The NATS connection dropped while a reply was awaited (nats-py reconnects)."""

    def __init__(self, subject: str) -> None:
        super().__init__(UNAVAILABLE, f"no reply on {subject}: {LOST}")


class NotConnected(ControlError):
    """A request while the NATS connection is down (reconnecting): nothing was sent."""

    def __init__(self, subject: str) -> None:
        super().__init__(UNAVAILABLE, f"NATS not connected (reconnecting): {subject} not sent")


class NoResponders(ControlError):
    def __init__(self, subject: str) -> None:
        super().__init__(UNAVAILABLE, f"no responders on {subject}: is the service running?")


class PublishDenied(ControlError):
    """nats-server refused a request's publish (``-ERR 'Permissions Violation for Publish
    to "<subject>"'``, or ``... for Publish with Reply of "<reply>"`` for a reply subject
    the server reserves): the request reached no one, so its caller fails at once,
    naming the subject, instead of waiting out its timeout for a reply that cannot come."""

    def __init__(self, subject: str, reply: str = "") -> None:
        if reply:  # refused for its reply subject alone, whatever the credentials
            msg = (
                f"permission denied: nats-server refused the publish to {subject}: its "
                f"reply subject {reply} is one the server reserves (_R_., $GNR.)"
            )
        else:
            msg = f"permission denied: these NATS credentials lack publish permission on {subject}"
        super().__init__(FORBIDDEN, msg)
        self.subject = subject
        self.reply = reply
