"""The Semaphores page's control for live limits and pauses: ``POST /api/semaphores/limit``.

The forms on each card of the page (see :mod:`celery_semaphore.views.flower`) post here;
scripts may too. The request sets a key's live limit (``key=openai&limit=30``) or clears it
(``key=openai&clear=1``) through :meth:`SemaphoreAdmin.set_limit`, or pauses the key
(``key=openai&pause=1``) or resumes it (``pause=0``) through :meth:`SemaphoreAdmin.pause` and
:meth:`~SemaphoreAdmin.resume`, recording the Flower user, the client's address and the
Flower process (``user@host pid N``) as who did it.

Who may post, in this order:

* As for Flower's own controls (revoke, terminate, pool resize): with no ``--basic_auth`` and no
  ``--auth``, the answer is 401 unless ``FLOWER_UNAUTHENTICATED_API`` is set; with either, the
  caller must pass it (401 for missing or wrong basic-auth credentials, 403 for no OAuth
  session).
* Every request must carry the XSRF token: the ``_xsrf`` cookie the page sets, echoed as the
  ``_xsrf`` form field or the ``X-XSRFToken`` header (403 otherwise). Flower 2.1 checks no token
  at all, and Flower 2.2 checks it only for OAuth sessions (with basic auth it relies on the
  ``Sec-Fetch-Site`` and ``Origin`` headers, which it still checks here first); a browser sends
  basic-auth credentials with a forged cross-site form too, so this control asks for the token
  whatever the version or the authentication.
* Flower's ``--read_only`` and ``app.conf.semaphore_flower_set_limit = False`` turn the control
  off (403).

Bad input (no key, a limit that is not an int from 1, both or neither of ``limit`` and
``clear``, ``pause`` beside either, or not a boolean) is answered 400 with the library's
message, and nothing is sent to Redis.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Callable
from typing import Any

import tornado.web
from tornado.ioloop import IOLoop

from ..core import validation as check
from ..core.live import setter
from ..errors import SemaphoreBackendError, SemaphoreValidationError

try:
    from flower.api import BaseApiHandler  # type: ignore[import-untyped]
    from flower.utils import strtobool  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the Semaphores page needs Flower 2.1 or later: pip install 'celery-semaphore[flower]'"
    ) from exc

__all__ = ["LiveLimitApi", "Pauser", "Setter", "refusal"]

Setter = Callable[[str, int | None, str], int | None]
"""``set_limit(key, limit_or_None, by)``, returning the live limit replaced: the signature of
:meth:`SemaphoreAdmin.set_limit`. It blocks (it runs in Flower's thread pool)."""

Pauser = Callable[[str, bool, str], bool]
"""``pause(key, paused, by)``: pause the key (``paused``) or resume it, returning whether it
was paused before (:meth:`SemaphoreAdmin.pause` and :meth:`~SemaphoreAdmin.resume`)."""

_INTEGER = re.compile(r"-?[0-9]{1,20}")


def _unauthenticated_api() -> bool:
    """Whether ``FLOWER_UNAUTHENTICATED_API`` opens Flower's API with no authentication, read
    as Flower reads it (an unreadable value counts as not set)."""
    try:
        return bool(strtobool(os.environ.get("FLOWER_UNAUTHENTICATED_API") or "false"))
    except ValueError:
        return False


def refusal(options: Any, set_limit: Setter | None) -> str | None:
    """Why this Flower must not change live limits, or None when it may.

    Args:
        options (tornado.options.OptionParser): Flower's options.
        set_limit (Setter | None): what changes them; None when turned off.

    Returns:
        str | None: a sentence for the page, and for the 403 that refuses a post.
    """
    if set_limit is None:
        return "it is turned off (app.conf.semaphore_flower_set_limit = False)"
    if options.read_only:
        return "Flower runs with --read_only"
    if not (options.basic_auth or options.auth) and not _unauthenticated_api():
        return (
            "Flower runs without authentication; as for Flower's own controls, set "
            "FLOWER_UNAUTHENTICATED_API=true to let anyone who can reach it change them"
        )
    return None


class LiveLimitApi(BaseApiHandler):  # type: ignore[misc]
    """``POST /api/semaphores/limit``: set or clear a key's live limit (see the module)."""

    def initialize(self, set_limit: Setter | None, pause: Pauser | None = None) -> None:
        self.set_limit = set_limit
        self.pause = pause
        self._csrf_due = False

    def check_xsrf_cookie(self) -> None:
        """Refuse a request without the XSRF token (and, on Flower 2.2, a cross-site one).

        Raises:
            tornado.web.HTTPError: 403, the token is missing or does not match the cookie.
        """
        # Flower 2.2 turns on xsrf_cookies, so tornado calls this before prepare(), ahead of
        # authentication: deferred to post(), a request without credentials is told 401 on
        # every version, and Flower 2.1, which never calls it, gets the check too.
        if not self._csrf_due:
            return
        super().check_xsrf_cookie()
        tornado.web.RequestHandler.check_xsrf_cookie(self)

    @tornado.web.authenticated
    async def post(self) -> None:
        """Set (``limit``) or clear (``clear``) the live limit of ``key``, or pause it
        (``pause=1``) or resume it (``pause=0``).

        Answers 200 with JSON ``{"key", "limit", "previous", "by"}`` (for a pause or a resume
        ``{"key", "paused", "was_paused", "by"}``), or, to a browser's plain
        form post (``Accept: text/html``), 303 to the Semaphores page; 400 for bad input, 403
        when turned off, 503 when Redis fails (plain-text reasons).
        """
        self._csrf_due = True
        self.check_xsrf_cookie()
        why = refusal(self.application.options, self.set_limit)
        if why is not None or self.set_limit is None:
            self._answer(403, f"Live limits cannot be changed here: {why}.")
            return
        who = self._who()
        body: dict[str, Any]
        try:
            key, limit, paused = self._arguments()
            if paused is not None and self.pause is not None:
                was = await IOLoop.current().run_in_executor(None, self.pause, key, paused, who)
                body = {"key": key, "paused": paused, "was_paused": was, "by": who}
            else:
                previous = await IOLoop.current().run_in_executor(
                    None, self.set_limit, key, limit, who
                )
                body = {"key": key, "limit": limit, "previous": previous, "by": who}
        except SemaphoreValidationError as exc:
            self._answer(400, str(exc))
            return
        except SemaphoreBackendError as exc:
            self._answer(503, str(exc))
            return
        if "text/html" in self.request.headers.get("Accept", ""):
            self.redirect(self.reverse_url("semaphores"), status=303)
            return
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.finish(json.dumps(body))

    def _argument(self, name: str) -> str | None:
        # Taken as sent: Flower's get_argument HTML-escapes values, and tornado's strips them,
        # either of which would name another key than "a&b" or " a".
        value: str | None = tornado.web.RequestHandler.get_argument(self, name, None, strip=False)
        return value

    def _arguments(self) -> tuple[str, int | None, bool | None]:
        """The key, the limit (None: clear) and the pause (None: neither a pause nor a
        resume) the request asks for.

        Raises:
            SemaphoreValidationError: no key, a bad limit, both or neither of limit and
                clear, or a pause that is not a boolean or comes with either.
        """
        key = check.check_key(self._argument("key"))
        raw, clear = self._argument("limit") or "", self._argument("clear") or ""
        pause = self._argument("pause")
        clearing = self._flag(key, "clear", clear) if clear else False
        if pause is not None:
            if raw or clear:
                raise SemaphoreValidationError("give pause alone, not with limit or clear", key)
            return key, None, self._flag(key, "pause", pause)
        if clearing == bool(raw):
            raise SemaphoreValidationError("give a limit, or clear=1 (not both)", key)
        if clearing:
            return key, None, None
        return key, check.check_limit(int(raw) if _INTEGER.fullmatch(raw) else raw), None

    @staticmethod
    def _flag(key: str, name: str, value: str) -> bool:
        try:
            return bool(strtobool(value))
        except ValueError:
            message = f"{name} must be true or false, got {value!r:.60}"
            raise SemaphoreValidationError(message, key) from None

    def _who(self) -> str:
        """Who is asking, for the record: the Flower user, their address, this process."""
        return f"{self._user()} via Flower from {self.request.remote_ip} ({setter()})"

    def _user(self) -> str:
        """The OAuth user, else the basic-auth user name, else ``anonymous``."""
        if isinstance(self.current_user, str):
            return self.current_user
        if self.application.options.basic_auth:
            # Flower checked these credentials before post() ran; only the name is kept.
            _, _, encoded = self.request.headers.get("Authorization", "").partition(" ")
            try:
                name = base64.b64decode(encoded, validate=True).decode().partition(":")[0]
            except (binascii.Error, UnicodeDecodeError):
                name = ""
            return name or "anonymous"
        return "anonymous"

    def _answer(self, status: int, message: str) -> None:
        # Written here rather than raised: Flower 2.1 writes an HTTPError's format string
        # rather than its message.
        self.set_status(status)
        self.set_header("Content-Type", "text/plain; charset=UTF-8")
        self.finish(message)
