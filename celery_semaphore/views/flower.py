"""A "Semaphores" page in Flower: every semaphore's holders, waiting room and live limit,
read from Redis.

Flower has no plugin API, but it reads its options from a Python file, ``flowerconfig.py``
in the directory it starts in (or the file ``--conf`` names), and runs it. One line there
adds the page to the ``celery flower`` you already run::

    import celery_semaphore.flower  # noqa: F401  (the Semaphores page and its API)

That import calls :func:`install`, which puts the routes below into the table Flower builds
its application from (before its catch-all 404 route, under its ``--url_prefix``) and adds a
"Semaphores" link to Flower's navbar on every page (see
:class:`NavbarWithSemaphores`). ``celery semaphore
flower`` (:func:`start_flower`) does the same without the file.

* ``/semaphores``: an HTML page in Flower's layout, one card a semaphore (key, slots in use,
  limit, runs queued) with a row a holder (task id linked to Flower's task page, task name,
  worker, pid, held for, expires in). It re-reads itself every :data:`REFRESH_SECONDS` s.
* ``/api/semaphores``: JSON, a page of :meth:`SemaphoreView.as_dict`, sorted by key:
  ``offset`` (default 0) and ``limit`` (default :data:`PAGE_SIZE`, at most
  :data:`~celery_semaphore.views.inspection.MAX_PAGE`) choose the keys, the
  ``X-Total-Count`` header says how many there are, and each lists the first ``waiting``
  (default :data:`WAITING_SHOWN`) of its parked runs beside their total, ``queued``.
* ``/api/semaphores/waiting``: JSON, one page of a key's waiting room
  (``?key=openai&offset=0&limit=100``): :meth:`WaitingPage.as_dict`, with ``total``.
* ``/api/semaphores/limit``: POST, sets or clears a key's live limit; the page's forms use it
  (see :class:`LiveLimitApi` for who may, and its CSRF check).

The semaphores read are those of the Celery app Flower monitors (``celery -A proj``): its
``semaphore_url`` and ``semaphore_prefix``, resolved at the first request. The page's
handler derives from Flower's ``BaseHandler`` and the API's from ``BaseApiHandler``, and each
guards its method with ``tornado.web.authenticated``, as Flower's own handlers do:
``--basic_auth``, ``--auth`` (OAuth) and the rule that the API answers 401 with no auth
configured unless ``FLOWER_UNAUTHENTICATED_API`` is set apply to them unchanged.

Needs Flower 2.1 or later (``pip install 'celery-semaphore[flower]'``).
"""

from __future__ import annotations

import atexit
import base64
import binascii
import functools
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import tornado.escape
import tornado.template
import tornado.web
from celery import Celery
from tornado.ioloop import IOLoop
from tornado.options import options as tornado_options

from ..core import validation as check
from ..core.live import setter
from ..errors import SemaphoreError, SemaphoreValidationError
from ..integration.settings import app_settings
from .cli import admin_of
from .inspection import SemaphoreView, WaitingPage, check_page, semaphore_keys, views, waiting_page
from .why import Standing, why

try:
    from flower import command as flower_command  # type: ignore[import-untyped]
    from flower import urls as flower_urls
    from flower.api import BaseApiHandler  # type: ignore[import-untyped]
    from flower.app import Flower, rewrite_handler  # type: ignore[import-untyped]
    from flower.utils import strtobool  # type: ignore[import-untyped]
    from flower.views import BaseHandler  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the Semaphores page needs Flower 2.1 or later: pip install 'celery-semaphore[flower]'"
    ) from exc

__all__ = [
    "PAGE_SIZE",
    "REFRESH_SECONDS",
    "WAITING_SHOWN",
    "SemaphoreSource",
    "add_semaphore_routes",
    "install",
    "start_flower",
]

REFRESH_SECONDS = 3.0
"""How often the page re-reads itself, seconds."""
PAGE_SIZE = 100
"""Semaphores in one page of ``/api/semaphores``, and parked runs in one page of
``/api/semaphores/waiting``, unless ``limit`` says otherwise."""
WAITING_SHOWN = 20
"""Parked runs ``/api/semaphores`` lists for each semaphore, unless ``waiting`` says
otherwise; the rest are paged through ``/api/semaphores/waiting``."""

T = TypeVar("T")

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


class SemaphoreSource:
    """What the page and its API read, and what the live-limit control calls.

    Args:
        client (redis.Redis): the semaphore store.
        prefix (str): its key prefix.
        set_limit (Setter | None): :meth:`SemaphoreAdmin.set_limit`, or None to offer no
            control (``/api/semaphores/limit`` then answers 403).
        pause (Pauser | None): pauses and resumes a key (None: no pause control).
    """

    def __init__(
        self, client: redis.Redis, prefix: str, set_limit: Setter | None,
        pause: Pauser | None = None,
    ) -> None:  # fmt: skip
        self.client = client
        self.prefix = prefix
        self.set_limit = set_limit
        self.pause = pause

    @classmethod
    def of_app(cls, app: Celery) -> SemaphoreSource:
        """The source of ``app``'s semaphores: its ``semaphore_url``, ``semaphore_prefix``,
        and ``semaphore_flower_set_limit``; raising a limit publishes the parked runs it
        hands slots to, as the CLI's does.

        Raises:
            SemaphoreValidationError: the app's settings are invalid or name no Redis.
            SemaphoreBackendError: a cluster store could not be reached.
        """
        settings = app_settings(app)
        client = settings.store.connect()
        admin = admin_of(app, client)
        if not settings.flower_set_limit:
            return cls(client, settings.prefix, None)

        def pause(key: str, paused: bool, by: str) -> bool:
            return admin.pause(key, by) if paused else admin.resume(key, by)

        return cls(client, settings.prefix, admin.set_limit, pause)

    def keys(self) -> list[str]:
        """Every key with a holder, a waiting room or a live limit, sorted."""
        return semaphore_keys(self.client, self.prefix)

    def views(self, keys: Sequence[str] | None = None, waiting: int = 1) -> list[SemaphoreView]:
        """A view of each of ``keys`` (None: every one), listing ``waiting`` parked runs."""
        return views(self.client, keys, self.prefix, waiting=waiting)

    def waiting(self, key: str, offset: int, limit: int) -> WaitingPage:
        """One page of ``key``'s waiting room (see :func:`waiting_page`)."""
        return waiting_page(self.client, key, self.prefix, offset, limit)

    def why(self, task_id: str) -> list[Standing]:
        """Where run ``task_id`` stands (see :func:`~.why.why`)."""
        return why(self.client, task_id, self.prefix)


_SOURCE_LOCK = threading.Lock()


def _source_of(flower_app: Any) -> SemaphoreSource:
    """The :class:`SemaphoreSource` of a Flower application: the one given to
    :func:`add_semaphore_routes` or :func:`start_flower`, else one made from the app it
    monitors, at its first request, and kept on the application.

    Raises:
        SemaphoreError: as :meth:`SemaphoreSource.of_app`.
    """
    with _SOURCE_LOCK:
        found: SemaphoreSource | None = getattr(flower_app, "semaphore_source", None)
        if found is None:
            found = flower_app.semaphore_source = SemaphoreSource.of_app(flower_app.capp)
        return found


def _routes() -> list[Any]:
    return [
        tornado.web.url(r"/semaphores", SemaphoresPage, name="semaphores"),
        tornado.web.url(r"/api/semaphores", SemaphoresApi),
        tornado.web.url(r"/api/semaphores/waiting", WaitingApi),
        tornado.web.url(r"/api/semaphores/why", WhyApi, name="semaphore_why"),
        tornado.web.url(r"/api/semaphores/limit", LiveLimitApi, name="semaphore_limit"),
    ]


def install() -> None:
    """Add the Semaphores page, its API and its navbar link to every Flower application this
    process builds from now on (``celery flower``'s, say), as ``flowerconfig.py``'s
    ``import celery_semaphore.flower`` does. Idempotent.

    The routes go into Flower's own route table (``flower.urls.handlers``) ahead of its
    catch-all 404 route, so Flower rewrites them under ``--url_prefix`` as it does its own;
    the navbar link comes from a ``Template`` UI module in Flower's settings.
    """
    table: list[Any] = flower_urls.handlers
    if not any(getattr(h, "name", None) == "semaphores" for h in table):
        last = next((i for i, h in enumerate(table) if _pattern(h) == ".*"), len(table))
        table[last:last] = _routes()
    modules = flower_urls.settings.setdefault("ui_modules", {})
    if isinstance(modules, dict):
        modules["Template"] = NavbarWithSemaphores


def _pattern(handler: Any) -> str:
    return str(handler.regex.pattern if isinstance(handler, tornado.web.url) else handler[0])


def start_flower(app: Celery, argv: Sequence[str]) -> None:
    """Run Flower for ``app`` with the Semaphores page, until SIGTERM or Ctrl-C.

    Blocks in tornado's IO loop, and sets process-wide state as ``celery flower`` does
    (tornado's global options, a SIGTERM handler, an ``atexit`` hook): call it once, as the
    main thing a process does.

    Args:
        app (celery.Celery): the app Flower monitors; its ``semaphore_url`` and
            ``semaphore_prefix`` say which semaphores the page shows, and
            ``semaphore_flower_set_limit`` whether it offers to change their live limits.
        argv (Sequence[str]): Flower's options, as ``celery flower`` takes them, e.g.
            ``["--port=5555", "--address=127.0.0.1", "--url_prefix=flower",
            "--basic_auth=user:password"]``. As with ``celery flower``, ``FLOWER_*``
            environment variables and ``flowerconfig.py`` apply too, and an argument that is
            not a Flower option is ignored.

    Raises:
        SemaphoreValidationError: the app's ``semaphore_*`` settings are invalid or name no
            Redis; checked before Flower starts.
        tornado.options.Error: an option's value has the wrong type (``--port=abc``).
        SystemExit: Flower rejected its options (``--auth``, ``--certfile`` without
            ``--keyfile``, ...), as ``celery flower`` does.
        OSError: the port could not be bound.
    """
    source = SemaphoreSource.of_app(app)
    install()
    flower_command.apply_env_options()
    flower_command.apply_options(sys.argv[0], list(argv))
    flower_command.extract_settings()
    flower_command.setup_logging()
    flower_app = Flower(capp=app, options=tornado_options, **flower_urls.settings)
    flower_app.semaphore_source = source
    atexit.register(flower_app.stop)
    signal.signal(signal.SIGTERM, flower_command.sigterm_handler)
    try:
        port = flower_app.start_http_server()
        flower_command.print_banner(app, "ssl_options" in flower_urls.settings, port)
        flower_app.start()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        source.client.close()


def add_semaphore_routes(flower_app: Any, source: SemaphoreSource | None = None) -> None:
    """Add the page's routes to a Flower application already built (for a Flower you start
    yourself; ``install()`` does it for those built after it).

    Routes go under the app's ``url_prefix`` and take precedence over Flower's catch-all 404
    route (tornado tries handlers added with ``add_handlers`` before the constructor's).

    Args:
        flower_app (flower.app.Flower): the application, before or after it serves.
        source (SemaphoreSource | None): what to read and how to set limits; None: the app
            that ``flower_app`` monitors (:meth:`SemaphoreSource.of_app`), at its first
            request.
    """
    if source is not None:
        flower_app.semaphore_source = source
    handlers: list[Any] = _routes()
    prefix = flower_app.options.url_prefix
    if prefix:
        handlers = [rewrite_handler(handler, prefix) for handler in handlers]
    flower_app.add_handlers(r".*", handlers)


async def _in_pool(call: Callable[[], T]) -> T:
    return await IOLoop.current().run_in_executor(None, call)


class SemaphoresPage(BaseHandler):  # type: ignore[misc]
    """``GET /semaphores``: the HTML page; 503 with a message when Redis fails."""

    @tornado.web.authenticated
    async def get(self) -> None:
        found: list[SemaphoreView] = []
        error = set_limit = None
        try:
            source = await _in_pool(lambda: _source_of(self.application))
            set_limit = source.set_limit
            found = await _in_pool(source.views)  # the page shows how many wait, and the oldest
        except SemaphoreError as exc:
            self.set_status(503)
            error = str(exc)
        # The cookie a form's token must match, even on a page with no form, for scripts.
        self.xsrf_token  # noqa: B018
        namespace = self.get_template_namespace()
        namespace.update(
            url_prefix=self.application.options.url_prefix, semaphores=found, error=error,
            seconds=seconds, utc=utc, refresh_ms=int(REFRESH_SECONDS * 1000), now=time.time(),
            limits_off=refusal(self.application.options, set_limit),
            limit_url=self.reverse_url("semaphore_limit"),
            why_url=self.reverse_url("semaphore_why"),
        )  # fmt: skip
        self.finish(page(self.get_template_path()).generate(**namespace))


class _Api(BaseApiHandler):  # type: ignore[misc]
    """What the API's handlers share: a plain-text answer, written here rather than raised
    (Flower 2.1 writes an HTTPError's format string rather than its message), how they
    answer a call into the store, and, for the GET handlers, their query's numbers and
    their read of the application's source."""

    def plain(self, status: int, message: str) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "text/plain; charset=UTF-8")
        self.finish(message)

    async def respond(self, call: Callable[[], T], write: Callable[[T], Any]) -> None:
        """``call()`` in Flower's thread pool, then what ``write`` makes of its answer as
        JSON (None: ``write`` answered itself); 400 or 503 with the reason."""
        try:
            found = await _in_pool(call)
        except SemaphoreError as exc:  # bad input, else the store failed
            self.plain(400 if isinstance(exc, SemaphoreValidationError) else 503, str(exc))
            return
        shown = write(found)
        if shown is not None:
            self.set_header("Content-Type", "application/json; charset=UTF-8")
            self.finish(json.dumps(shown, default=str))

    def number(self, name: str, default: int) -> object:
        """Query argument ``name`` as an int when it is one (else as sent, to be refused)."""
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        return int(raw) if raw.isdigit() and len(raw) < 10 else raw

    async def answer(self, read: Callable[[SemaphoreSource], T], write: Callable[[T], Any]) -> None:
        """``read`` the application's source, then write JSON (see :meth:`respond`)."""
        await self.respond(lambda: read(_source_of(self.application)), write)


class SemaphoresApi(_Api):
    """``GET /api/semaphores[?offset=0&limit=100&waiting=20]``: a JSON list of
    :meth:`SemaphoreView.as_dict`, sorted by key, one page of them; ``X-Total-Count`` says
    how many semaphores there are. 400 for a bad number, 503 when Redis fails."""

    @tornado.web.authenticated
    async def get(self) -> None:
        numbers = (self.number("offset", 0), self.number("limit", PAGE_SIZE))
        shown = self.number("waiting", WAITING_SHOWN)

        def read(source: SemaphoreSource) -> tuple[int, list[SemaphoreView]]:
            offset, limit = check_page(*numbers)
            waiting = check_page(0, shown)[1]
            keys = source.keys()
            return len(keys), source.views(keys[offset : offset + limit], waiting)

        def write(found: tuple[int, list[SemaphoreView]]) -> list[dict[str, Any]]:
            self.set_header("X-Total-Count", str(found[0]))
            return [sem.as_dict() for sem in found[1]]

        await self.answer(read, write)


class WaitingApi(_Api):
    """``GET /api/semaphores/waiting?key=K[&offset=0&limit=100]``: one page of ``K``'s
    waiting room, first served first, as :meth:`WaitingPage.as_dict` (with ``total``). 400
    for a missing key or a bad number, 503 when Redis fails."""

    @tornado.web.authenticated
    async def get(self) -> None:
        # Taken as sent: tornado strips an argument, which would name another key than " a".
        key = tornado.web.RequestHandler.get_query_argument(self, "key", None, strip=False)
        offset, limit = self.number("offset", 0), self.number("limit", PAGE_SIZE)

        def read(source: SemaphoreSource) -> WaitingPage:
            return source.waiting(key, *check_page(offset, limit))  # type: ignore[arg-type]

        await self.answer(read, lambda found: found.as_dict())


class WhyApi(_Api):
    """``GET /api/semaphores/why?task_id=T``: where run ``T`` stands, as ``celery semaphore
    why --json`` prints it (``standings``: one per room it waits in or key it holds; empty
    when none). 400 for a missing id, 503 when Redis fails."""

    @tornado.web.authenticated
    async def get(self) -> None:
        task_id = tornado.web.RequestHandler.get_query_argument(self, "task_id", None, strip=False)
        await self.answer(lambda source: source.why(task_id),  # type: ignore[arg-type]
                          lambda found: {"task_id": task_id,
                                         "standings": [s.as_dict() for s in found]})  # fmt: skip


class LiveLimitApi(_Api):
    """``POST /api/semaphores/limit``: the page's control for live limits and pauses.

    The forms on each card of the page post here; scripts may too. The request sets a key's
    live limit (``key=openai&limit=30``) or clears it (``key=openai&clear=1``) through
    :meth:`SemaphoreAdmin.set_limit`, or pauses the key (``key=openai&pause=1``) or resumes
    it (``pause=0``) through :meth:`SemaphoreAdmin.pause` and :meth:`~SemaphoreAdmin.resume`,
    recording the Flower user, the client's address and the Flower process
    (``user@host pid N``) as who did it.

    Who may post, in this order:

    * As for Flower's own controls (revoke, terminate, pool resize): with no
      ``--basic_auth`` and no ``--auth``, the answer is 401 unless
      ``FLOWER_UNAUTHENTICATED_API`` is set; with either, the caller must pass it (401 for
      missing or wrong basic-auth credentials, 403 for no OAuth session).
    * Every request must carry the XSRF token: the ``_xsrf`` cookie the page sets, echoed as
      the ``_xsrf`` form field or the ``X-XSRFToken`` header (403 otherwise). Flower 2.1
      checks no token at all, and Flower 2.2 checks it only for OAuth sessions (with basic
      auth it relies on the ``Sec-Fetch-Site`` and ``Origin`` headers, which it still checks
      here first); a browser sends basic-auth credentials with a forged cross-site form too,
      so this control asks for the token whatever the version or the authentication.
    * Flower's ``--read_only`` and ``app.conf.semaphore_flower_set_limit = False`` turn the
      control off (403).

    Bad input (no key, a limit that is not an int from 1, both or neither of ``limit`` and
    ``clear``, ``pause`` beside either, or not a boolean) is answered 400 with the library's
    message, and nothing is sent to Redis. The setter and pauser are the application's
    source's (see :class:`SemaphoreSource`).
    """

    def initialize(self) -> None:
        try:
            source = _source_of(self.application)
            self.set_limit, self.pause = source.set_limit, source.pause
        except SemaphoreError:
            self.set_limit = self.pause = None  # the page says why; a post is refused
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
            self.plain(403, f"Live limits cannot be changed here: {why}.")
            return
        # Who asks, for the record: the Flower user, their address, this process.
        who = f"{self._user()} via Flower from {self.request.remote_ip} ({setter()})"
        set_limit, pause = self.set_limit, self.pause

        def change() -> dict[str, Any]:
            key, limit, paused = self._arguments()
            if paused is not None and pause is not None:
                return {"key": key, "paused": paused, "was_paused": pause(key, paused, who),
                        "by": who}  # fmt: skip
            return {"key": key, "limit": limit, "previous": set_limit(key, limit, who), "by": who}

        def written(body: dict[str, Any]) -> dict[str, Any] | None:
            if "text/html" not in self.request.headers.get("Accept", ""):
                return body
            self.redirect(self.reverse_url("semaphores"), status=303)
            return None

        await self.respond(change, written)

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
            raise SemaphoreValidationError(
                f"{name} must be true or false, got {value!r:.60}", key
            ) from None

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


# The page's HTML, and the link to it in Flower's navbar. The page extends Flower's own
# base.html (navbar, styles, scripts) and re-reads itself every few seconds. Flower's
# templates have no hook for a navbar entry, but they draw the navbar through tornado's
# Template UI module: NavbarWithSemaphores stands in for that module and adds a
# "Semaphores" link to the first list of the navbar, on every Flower page.


class NavbarWithSemaphores(tornado.web.TemplateModule):
    """Tornado's ``Template`` UI module, plus a "Semaphores" link at the end of the first
    list of Flower's ``navbar.html`` (marked ``data-semaphores-nav``, and current on the
    Semaphores page). Any other template, and a navbar whose application has no route named
    ``semaphores``, render as they are."""

    def render(self, path: str, **kwargs: Any) -> bytes:
        html: bytes = super().render(path, **kwargs)
        if path != "navbar.html" or b"</ul>" not in html:
            return html
        try:
            url = self.handler.reverse_url("semaphores")
        except KeyError:
            return html
        here = self.request.path == url
        active, current = (" active", ' aria-current="page"') if here else ("", "")
        href = tornado.escape.xhtml_escape(url)
        link = (f'<li class="nav-item"><a class="nav-link{active}" data-semaphores-nav '
                f'href="{href}"{current}>Semaphores</a></li>')  # fmt: skip
        return html.replace(b"</ul>", link.encode() + b"</ul>", 1)


def seconds(value: float) -> str:
    """``12.3 s`` under a minute, else ``4m 05s`` or ``2h 03m``."""
    if value < 60:
        return f"{max(value, 0.0):.1f} s"
    minutes, secs = divmod(round(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def utc(epoch: float) -> str:
    """``2026-12-01 18:40:02 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


@functools.lru_cache(maxsize=4)
def page(template_path: str) -> tornado.template.Template:
    """The page's template, extending Flower's ``base.html`` from ``template_path``."""
    return tornado.template.Template(
        _PAGE, name="semaphores.html", loader=tornado.template.Loader(template_path)
    )


# Flower's base.html gives the navbar, styles and scripts. The navbar's link comes from
# NavbarWithSemaphores where install() put it there; on a Flower app given the routes alone
# (add_semaphore_routes), the page adds the link to the navbar it shows itself.
_PAGE = """{% extends "base.html" %}
{% block title %}Semaphores · Flower{% end %}
{% block container %}
<div class="page-section semaphores-page">
  <header class="page-header">
    <div>
      <p class="page-eyebrow">celery-semaphore</p>
      <h1 class="h3 mb-0">Semaphores</h1>
    </div>
    <div class="refresh-status" aria-live="polite">
      <span class="status-dot status-dot-live" id="semaphores-live" aria-hidden="true"></span>
      <span id="semaphores-status">Refreshes every {{ refresh_ms // 1000 }} s</span>
    </div>
  </header>
  <div id="semaphores">
    {% if error %}
    <div class="alert alert-danger" role="alert">Cannot read the semaphores: {{ error }}</div>
    {% elif not semaphores %}
    <p class="text-body-secondary" id="no-semaphores">No semaphore has a live holder.</p>
    {% end %}
    {% for sem in semaphores %}
    <section class="card mb-4 semaphore" data-key="{{ sem.key }}">
      <div class="card-header d-flex justify-content-between align-items-center">
        <h2 class="h5 mb-0 font-monospace">{{ sem.key }}</h2>
        <span class="semaphore-usage"><strong>{{ sem.in_use }}</strong> of
          {{ sem.limit if sem.limit is not None else "?" }} in use
          {% if sem.waiting %}&middot; <strong class="semaphore-queued">{{ sem.queued }}</strong>
          queued (oldest {{ seconds(sem.oldest_wait) }}){% end %}</span>
      </div>
      <div class="card-body py-2 d-flex flex-wrap gap-2 align-items-center small">
        {% if sem.paused %}<span class="semaphore-paused badge text-bg-warning">Paused by
          {{ sem.paused.by }} at {{ utc(sem.paused.paused_at) }}</span>{% end %}
        {% set fed = sem.feedback %}{% if fed and fed.limit is not None %}<span
          class="semaphore-adaptive">Adaptive limit <strong>{{ fed.limit }}</strong>
          ({{ fed.min }} to {{ fed.max }})</span>{% end %}
        {% if fed and fed.back_offs %}{% set cooling = fed.cooling(now) %}<span
          class="semaphore-cooling badge {{ "text-bg-danger" if cooling else "text-bg-light" }}"
          >{{ "Cooling down until" if cooling else "Cooled down at" }}
          {{ utc(fed.cooling_until) }}: {{ fed.back_offs }} back-off(s), the last by
          {{ fed.last_by }} ({{ "no hint" if fed.last_hint is None else seconds(fed.last_hint)
          }})</span>{% end %}
        <span class="live-limit me-auto">{% if sem.live %}Live limit
          <strong>{{ sem.live.limit }}</strong>, set by {{ sem.live.by }}
          at {{ utc(sem.live.set_at) }}{% else %}No live limit: the callers' limit
          applies{% end %}</span>
        {% for rate in sem.rates %}<span class="semaphore-rate">Rate {{ rate.name }}:
          {% if rate.left is not None %}{{ rate.left }} of {{ rate.burst }} free, one every
          {{ "%g" % rate.interval }} s{% else %}next due {{ utc(rate.next_due) }}{% end %}
          {% if rate.live %}(live {{ rate.live.spec }}, set by {{ rate.live.by }}){% end %}
        </span>{% end %}
        {% if not limits_off %}
        <form class="live-limit-form d-flex gap-2" method="post" action="{{ limit_url }}">
          {% raw xsrf_form_html() %}<input type="hidden" name="key" value="{{ sem.key }}">
          <input class="form-control form-control-sm" style="width: 8rem" type="number" min="1"
            max="2147483647" name="limit" required placeholder="new limit"
            aria-label="Live limit of {{ sem.key }}">
          <button class="btn btn-sm btn-outline-primary text-nowrap" type="submit">Set</button>
        </form>
        {% if sem.live %}
        <form class="live-limit-form" method="post" action="{{ limit_url }}">
          {% raw xsrf_form_html() %}<input type="hidden" name="key" value="{{ sem.key }}">
          <input type="hidden" name="clear" value="1">
          <button class="btn btn-sm btn-outline-secondary" type="submit">Clear</button>
        </form>
        {% end %}
        <form class="live-limit-form" method="post" action="{{ limit_url }}">
          {% raw xsrf_form_html() %}<input type="hidden" name="key" value="{{ sem.key }}">
          <input type="hidden" name="pause" value="{{ 0 if sem.paused else 1 }}">
          <button class="btn btn-sm btn-outline-warning"
            type="submit">{{ "Resume" if sem.paused else "Pause" }}</button>
        </form>{% end %}
      </div>
      <div class="table-responsive">
        <table class="table table-hover align-middle mb-0" style="table-layout: fixed">
          <colgroup>
            <col style="width: 34%"><col style="width: 18%"><col style="width: 20%">
            <col style="width: 8%"><col style="width: 10%"><col style="width: 10%">
          </colgroup>
          <thead>
            <tr><th>Task</th><th>Name</th><th>Worker</th><th class="text-end">PID</th>
              <th class="text-end">Held for</th><th class="text-end">Expires in</th></tr>
          </thead>
          <tbody>
            {% for holder in sem.holders %}
            {% set meta = holder.metadata %}
            <tr class="holder" data-task-id="{{ meta.get('task_id') or '' }}">
              <td class="font-monospace text-truncate">
                {% if meta.get("task_id") %}
                <a href="{{ reverse_url('task', meta['task_id']) }}">{{ meta["task_id"] }}</a>
                {% else %}
                <span class="text-body-secondary" title="token {{ holder.token }}">no task</span>
                {% end %}
              </td>
              {% set handed = "—" %}
              {% if "reserved_for" in meta %}{% set handed = "handed off" %}{% end %}
              {% if meta.get("waiting") %}{% set handed = "kept: waits for other keys" %}{% end %}
              <td class="text-truncate">{{ meta.get("task_name") or handed }}</td>
              <td class="text-truncate">{{ meta.get("worker") or meta.get("host") or "—" }}</td>
              <td class="text-end">{{ meta.get("pid", "—") }}</td>
              <td class="text-end">{{ seconds(holder.held_for) }}</td>
              <td class="text-end">{{ seconds(holder.expires_in) }}</td>
            </tr>
            {% end %}
            {% if not sem.holders %}
            <tr><td colspan="6" class="text-body-secondary">No live holder.</td></tr>
            {% end %}
          </tbody>
        </table>
      </div>
    </section>
    {% end %}
  </div>
  {% if limits_off %}
  <p class="small text-body-secondary" id="live-limits-off">Live limits cannot be changed from
    this page: {{ limits_off }}.</p>
  {% else %}
  <form class="live-limit-form d-flex flex-wrap gap-2 align-items-center small" method="post"
    action="{{ limit_url }}">
    {% raw xsrf_form_html() %}<label for="live-limit-key">Live limit of another key</label>
    <input class="form-control form-control-sm font-monospace" style="width: 16rem" name="key"
      id="live-limit-key" required placeholder="key">
    <input class="form-control form-control-sm" style="width: 8rem" type="number" min="1"
      max="2147483647" name="limit" required placeholder="limit" aria-label="Live limit">
    <button class="btn btn-sm btn-outline-primary" type="submit">Set</button>
  </form>
  {% end %}
  <p class="small mt-2" id="live-limit-message" role="status" aria-live="polite"></p>
  <section class="card mt-4" id="why-box">
    <div class="card-header"><h2 class="h6 mb-0">Why is a task waiting?</h2></div>
    <div class="card-body small">
      <form id="why-form" class="d-flex flex-wrap gap-2" method="get" action="{{ why_url }}">
        <input class="form-control form-control-sm font-monospace" style="width: 24rem"
          name="task_id" id="why-task-id" required placeholder="task id" aria-label="Task id">
        <button class="btn btn-sm btn-outline-primary" type="submit">Why</button>
      </form>
      <ul class="list-unstyled mt-2 mb-0" id="why-answer" role="status" aria-live="polite"></ul>
    </div>
  </section>
</div>
{% end %}
{% block extra_scripts %}
<script>
(function () {
  var nav = document.querySelector(".app-nav, .navbar-nav");
  if (nav && !nav.querySelector("[data-semaphores-nav]")) {
    nav.querySelectorAll(".nav-link.active").forEach(function (a) {
      a.classList.remove("active");
    });
    var item = document.createElement("li");
    item.className = "nav-item";
    item.innerHTML = '<a class="nav-link active" aria-current="page">Semaphores</a>';
    item.firstChild.href = window.location.pathname;
    nav.appendChild(item);
  }
  var status = document.getElementById("semaphores-status");
  var dot = document.getElementById("semaphores-live");
  var message = document.getElementById("live-limit-message");
  var timer = null;
  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(refresh, {{ refresh_ms }});
  }
  // A refresh replaces the cards: not while a limit is being typed into one of them.
  function editing() {
    var box = document.getElementById("semaphores");
    var active = document.activeElement;
    var inputs = box.querySelectorAll("input[name=limit]");
    return (box.contains(active) && Boolean(active.form)) ||
      Array.prototype.some.call(inputs, function (input) { return input.value !== ""; });
  }
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!form.classList.contains("live-limit-form")) { return; }
    event.preventDefault();
    fetch(form.action, {method: "POST", credentials: "same-origin",
                        headers: {"Accept": "application/json"},
                        body: new URLSearchParams(new FormData(form))})
      .then(function (response) {
        if (response.ok) { return response.json(); }
        return response.text().then(function (text) { throw new Error(text); });
      })
      .then(function (done) {
        message.className = "small mt-2 text-success";
        if ("paused" in done) {
          message.textContent = done.key + (done.paused ? " paused." : " resumed.");
        } else {
          var now = done.limit === null ? "cleared" : "set to " + done.limit;
          var was = done.previous === null ? "none" : done.previous;
          message.textContent = "Live limit of " + done.key + " " + now + " (was " + was + ").";
        }
        form.reset();
        document.activeElement.blur();
        refresh();
      })
      .catch(function (err) {
        message.className = "small mt-2 text-danger";
        message.textContent = "Not changed: " + err.message;
      });
  });
  function refresh() {
    if (editing()) { schedule(); return; }
    fetch(window.location.href, {credentials: "same-origin", cache: "no-store"})
      .then(function (response) { return response.text(); })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("semaphores");
        if (!fresh) { throw new Error("no semaphores in the response"); }
        document.getElementById("semaphores").replaceWith(fresh);
        document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
        status.textContent = "Updated " + new Date().toLocaleTimeString();
        dot.className = "status-dot status-dot-live";
      })
      .catch(function (err) {
        status.textContent = "Refresh failed: " + err.message;
        dot.className = "status-dot status-dot-error";
      })
      .finally(schedule);
  }
  schedule();

  // "Why is it waiting": the answer of /api/semaphores/why, one line per room or key;
  // ?why=<task id> in the page's address asks on load (a link can point at a run).
  var whyForm = document.getElementById("why-form");
  var whyInput = document.getElementById("why-task-id");
  var whyAnswer = document.getElementById("why-answer");
  function secs(value) { return value === null ? "?" : value.toFixed(1) + " s"; }
  function standingText(s) {
    if (s.state === "holding") { return "holds a slot: its body runs"; }
    if (s.state === "reserved") {
      return "a slot is reserved for it; its message is on its way (the reservation waits " +
        secs(s.reserved_for) + " more)";
    }
    if (s.state === "passive") {
      return "waits for its other keys; this room serves runs behind it meanwhile";
    }
    var text = "parked, " + s.position + " of " + s.queued + " in line, waiting " +
      secs(s.waited);
    if (s.gives_up_in !== null) { text += "; gives up in " + secs(s.gives_up_in); }
    return text;
  }
  function limitText(s) {
    var text = "limit " + (s.limit === null ? "?" : s.limit);
    if (s.live) { text += " (live limit set by " + s.live.by + ")"; }
    if (s.paused) { text += "; paused by " + s.paused.by; }
    if (s.feedback && s.feedback.cooling_until * 1000 > Date.now()) {
      text += "; cooling down after a back-off (" + s.feedback.last_by + ")";
    }
    return text + "; " + s.holders.length + " holder(s)";
  }
  function line(text, className) {
    var item = document.createElement("li");
    item.textContent = text;
    if (className) { item.className = className; }
    whyAnswer.appendChild(item);
  }
  function ask(taskId) {
    whyAnswer.replaceChildren();
    // Against the origin: a page opened as user:password@host resolves its links with the
    // credentials in them, which fetch() refuses.
    var url = new URL(whyForm.getAttribute("action"), window.location.origin);
    url.searchParams.set("task_id", taskId);
    fetch(url,
          {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (response) {
        if (response.ok) { return response.json(); }
        return response.text().then(function (text) { throw new Error(text); });
      })
      .then(function (found) {
        if (!found.standings.length) {
          line("No waiting room holds " + taskId + " and it holds no slot: it has not " +
               "parked yet, or it has finished (see its task page).", "why-none");
        }
        found.standings.forEach(function (s) {
          line(s.key + ": " + standingText(s) + "; " + limitText(s) + ".", "why-" + s.state);
        });
        document.body.dataset.why = taskId;
      })
      .catch(function (err) { line("Cannot tell: " + err.message, "text-danger"); });
  }
  whyForm.addEventListener("submit", function (event) {
    event.preventDefault();
    var taskId = whyInput.value.trim();
    var address = new URL(window.location.href);
    address.searchParams.set("why", taskId);
    window.history.replaceState(null, "", address);
    ask(taskId);
  });
  var asked = new URLSearchParams(window.location.search).get("why");
  if (asked) { whyInput.value = asked; ask(asked); }
})();
</script>
{% end %}
"""
