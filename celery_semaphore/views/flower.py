"""A "Semaphores" page in Flower: every semaphore's holders, waiting room and live limit,
read from Redis.

Flower has no plugin API, but it reads its options from a Python file, ``flowerconfig.py``
in the directory it starts in (or the file ``--conf`` names), and runs it. One line there
adds the page to the ``celery flower`` you already run::

    import celery_semaphore.flower  # noqa: F401  (the Semaphores page and its API)

That import calls :func:`install`, which puts the routes below into the table Flower builds
its application from (before its catch-all 404 route, under its ``--url_prefix``) and adds a
"Semaphores" link to Flower's navbar on every page (see
:class:`~celery_semaphore.views.flower_page.NavbarWithSemaphores`). ``celery semaphore
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
  (see :mod:`celery_semaphore.views.flower_limits` for who may, and its CSRF check).

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
import json
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import tornado.routing
import tornado.web
from celery import Celery
from tornado.ioloop import IOLoop
from tornado.options import options as tornado_options

from ..core.admin import SemaphoreAdmin
from ..core.handoff import HandoffRoute
from ..errors import SemaphoreError, SemaphoreValidationError
from ..integration.settings import app_settings
from ..integration.waiting_room.handoffs import publisher_for
from .flower_limits import LiveLimitApi, Pauser, Setter, refusal
from .flower_page import NavbarWithSemaphores, page, seconds, utc
from .inspection import SemaphoreView, WaitingPage, check_page, semaphore_keys, views, waiting_page
from .why import Standing, why

try:
    from flower import command as flower_command  # type: ignore[import-untyped]
    from flower import urls as flower_urls
    from flower.api import BaseApiHandler  # type: ignore[import-untyped]
    from flower.app import Flower, rewrite_handler  # type: ignore[import-untyped]
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
        route = HandoffRoute(settings.policy.claim_timeout, publisher_for(app),
                             settings.policy.handoff_grace)  # fmt: skip
        admin = SemaphoreAdmin(client, settings.prefix, route)
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


class _Sources:
    """The :class:`SemaphoreSource` of each Flower application: one given to
    :func:`add_semaphore_routes`, else made from the app it monitors, at its first request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: weakref.WeakKeyDictionary[Any, SemaphoreSource] = weakref.WeakKeyDictionary()

    def give(self, flower_app: Any, source: SemaphoreSource) -> None:
        with self._lock:
            self._made[flower_app] = source

    def of(self, flower_app: Any) -> SemaphoreSource:
        """Raises: SemaphoreError, as :meth:`SemaphoreSource.of_app`."""
        with self._lock:
            found = self._made.get(flower_app)
            if found is None:
                found = self._made[flower_app] = SemaphoreSource.of_app(flower_app.capp)
            return found


SOURCES = _Sources()


def _routes() -> list[Any]:
    given = {"sources": SOURCES}
    return [
        tornado.web.url(r"/semaphores", SemaphoresPage, given, name="semaphores"),
        tornado.web.url(r"/api/semaphores", SemaphoresApi, given),
        tornado.web.url(r"/api/semaphores/waiting", WaitingApi, given),
        tornado.web.url(r"/api/semaphores/why", WhyApi, given, name="semaphore_why"),
        tornado.web.url(r"/api/semaphores/limit", LimitApi, given, name="semaphore_limit"),
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
    return str(
        handler.regex.pattern if isinstance(handler, tornado.routing.URLSpec) else handler[0]
    )


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
    SOURCES.give(flower_app, source)
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
        SOURCES.give(flower_app, source)
    handlers: list[Any] = _routes()
    prefix = flower_app.options.url_prefix
    if prefix:
        handlers = [rewrite_handler(handler, prefix) for handler in handlers]
    flower_app.add_handlers(r".*", handlers)


async def _in_pool(call: Callable[[], T]) -> T:
    return await IOLoop.current().run_in_executor(None, call)


class SemaphoresPage(BaseHandler):  # type: ignore[misc]
    """``GET /semaphores``: the HTML page; 503 with a message when Redis fails."""

    def initialize(self, sources: _Sources) -> None:
        self.sources = sources

    @tornado.web.authenticated
    async def get(self) -> None:
        found: list[SemaphoreView] = []
        error = set_limit = None
        try:
            source = await _in_pool(lambda: self.sources.of(self.application))
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
            seconds=seconds, utc=utc, refresh_ms=int(REFRESH_SECONDS * 1000),
            limits_off=refusal(self.application.options, set_limit),
            limit_url=self.reverse_url("semaphore_limit"),
            why_url=self.reverse_url("semaphore_why"),
        )  # fmt: skip
        self.finish(page(self.get_template_path()).generate(**namespace))


class _JsonApi(BaseApiHandler):  # type: ignore[misc]
    """What the API's GET handlers share: their source, their query's numbers, and answers
    written here rather than raised (Flower 2.1 would write an HTTPError's format string)."""

    def initialize(self, sources: _Sources) -> None:
        self.sources = sources

    def number(self, name: str, default: int) -> object:
        """Query argument ``name`` as an int when it is one (else as sent, to be refused)."""
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        return int(raw) if raw.isdigit() and len(raw) < 10 else raw

    async def answer(self, read: Callable[[SemaphoreSource], T], write: Callable[[T], Any]) -> None:
        """Read in Flower's thread pool, then write JSON; 400 or 503 with the reason."""
        try:
            source = await _in_pool(lambda: self.sources.of(self.application))
            found = await _in_pool(lambda: read(source))
        except SemaphoreValidationError as exc:
            self.plain(400, str(exc))
            return
        except SemaphoreError as exc:
            self.plain(503, str(exc))
            return
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.finish(json.dumps(write(found), default=str))

    def plain(self, status: int, message: str) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "text/plain; charset=UTF-8")
        self.finish(message)


class SemaphoresApi(_JsonApi):
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


class WaitingApi(_JsonApi):
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


class WhyApi(_JsonApi):
    """``GET /api/semaphores/why?task_id=T``: where run ``T`` stands, as ``celery semaphore
    why --json`` prints it (``standings``: one per room it waits in or key it holds; empty
    when none). 400 for a missing id, 503 when Redis fails."""

    @tornado.web.authenticated
    async def get(self) -> None:
        task_id = tornado.web.RequestHandler.get_query_argument(self, "task_id", None, strip=False)
        await self.answer(lambda source: source.why(task_id),  # type: ignore[arg-type]
                          lambda found: {"task_id": task_id,
                                         "standings": [s.as_dict() for s in found]})  # fmt: skip


class LimitApi(LiveLimitApi):
    """``POST /api/semaphores/limit`` (see :class:`LiveLimitApi`), with the application's
    source's setter."""

    def initialize(self, sources: _Sources) -> None:  # type: ignore[override]
        try:
            source = sources.of(self.application)
            set_limit, pause = source.set_limit, source.pause
        except SemaphoreError:
            set_limit = pause = None  # the page says why; a post is refused
        super().initialize(set_limit, pause)
