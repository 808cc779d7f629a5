"""A "Semaphores" page in Flower: every semaphore's live holders, read from Redis.

Flower has no plugin API. :func:`start_flower` runs Flower the way ``celery flower`` does
(Flower's own option parsing, ``FLOWER_*`` environment variables, ``flowerconfig.py``,
settings, logging and HTTP server) and adds three routes to the tornado application that
Flower builds, under Flower's ``--url_prefix``:

* ``/semaphores``: an HTML page in Flower's layout, one card a semaphore (key, slots in use,
  limit) with a row a holder (task id linked to Flower's task page, task name, worker, pid,
  held for, expires in). It re-reads itself every :data:`REFRESH_SECONDS` seconds.
* ``/api/semaphores``: JSON, a list of :meth:`SemaphoreView.as_dict` for every semaphore.
* ``/api/semaphores/limit``: POST, sets or clears a key's live limit; the page's forms use it
  (see :mod:`celery_semaphore.views.flower_limits` for who may, and its CSRF check).

The page's handler derives from Flower's ``BaseHandler`` and the API's from Flower's
``BaseApiHandler``, and both guard ``get`` with ``tornado.web.authenticated``, as Flower's own
handlers do: ``--basic_auth``, ``--auth`` (OAuth) and the rule that the API answers 401 with
no auth configured unless ``FLOWER_UNAUTHENTICATED_API`` is set apply to them unchanged, and
to the live-limit control.

Needs Flower 2.1 or later (``pip install 'celery-semaphore[flower]'``).
"""

from __future__ import annotations

import atexit
import functools
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import tornado.template
import tornado.web
from celery import Celery
from tornado.ioloop import IOLoop
from tornado.options import options as tornado_options

from ..core.admin import SemaphoreAdmin
from ..core.room import HandoffRoute
from ..errors import SemaphoreBackendError
from ..integration.room import publisher_for
from ..integration.settings import app_settings
from .flower_limits import LiveLimitApi, Setter, refusal
from .inspection import SemaphoreView, views

try:
    from flower import command as flower_command  # type: ignore[import-untyped]
    from flower.api import BaseApiHandler  # type: ignore[import-untyped]
    from flower.app import Flower, rewrite_handler  # type: ignore[import-untyped]
    from flower.urls import settings as flower_settings  # type: ignore[import-untyped]
    from flower.views import BaseHandler  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the Semaphores page needs Flower 2.1 or later: pip install 'celery-semaphore[flower]'"
    ) from exc

__all__ = ["REFRESH_SECONDS", "add_semaphore_routes", "start_flower"]

REFRESH_SECONDS = 3.0
"""How often the page re-reads itself, seconds."""

Reader = Callable[[], list[SemaphoreView]]
"""Returns the semaphores to show; may block (it runs in Flower's thread pool)."""


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
    settings = app_settings(app)
    flower_command.apply_env_options()
    flower_command.apply_options(sys.argv[0], list(argv))
    flower_command.extract_settings()
    flower_command.setup_logging()
    client = settings.store.connect()
    flower_app = Flower(capp=app, options=tornado_options, **flower_settings)
    # As the CLI does: raising a limit publishes the parked runs it hands slots to.
    route = HandoffRoute(settings.policy.claim_timeout, publisher_for(app),
                         settings.policy.handoff_grace)  # fmt: skip
    admin = SemaphoreAdmin(client, settings.prefix, route)
    add_semaphore_routes(
        flower_app,
        functools.partial(views, client, prefix=settings.prefix),
        admin.set_limit if settings.flower_set_limit else None,
    )
    atexit.register(flower_app.stop)
    signal.signal(signal.SIGTERM, flower_command.sigterm_handler)
    try:
        port = flower_app.start_http_server()
        flower_command.print_banner(app, "ssl_options" in flower_settings, port)
        flower_app.start()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        client.close()


def add_semaphore_routes(flower_app: Any, read: Reader, set_limit: Setter | None = None) -> None:
    """Add ``/semaphores``, ``/api/semaphores`` and ``/api/semaphores/limit`` to a Flower
    application.

    Routes go under the app's ``url_prefix`` and take precedence over Flower's catch-all 404
    route (tornado tries handlers added with ``add_handlers`` before the constructor's).

    Args:
        flower_app (flower.app.Flower): the application, before or after it serves.
        read (Callable[[], list[SemaphoreView]]): what to show, called once a request in
            Flower's thread pool; it may raise :class:`SemaphoreBackendError`.
        set_limit (Setter | None): what the live-limit control calls, in Flower's thread
            pool (:meth:`SemaphoreAdmin.set_limit`); None: the page offers no control, and
            ``/api/semaphores/limit`` answers 403.
    """
    page = {"read": read, "set_limit": set_limit}
    handlers = [
        tornado.web.url(r"/semaphores", SemaphoresPage, page, name="semaphores"),
        tornado.web.url(r"/api/semaphores", SemaphoresApi, {"read": read}),
        tornado.web.url(
            r"/api/semaphores/limit", LiveLimitApi, {"set_limit": set_limit}, name="semaphore_limit"
        ),
    ]
    prefix = flower_app.options.url_prefix
    if prefix:
        handlers = [rewrite_handler(handler, prefix) for handler in handlers]
    flower_app.add_handlers(r".*", handlers)


class SemaphoresPage(BaseHandler):  # type: ignore[misc]
    """``GET /semaphores``: the HTML page; 503 with a message when Redis fails."""

    def initialize(self, read: Reader, set_limit: Setter | None = None) -> None:
        self.read = read
        self.set_limit = set_limit

    @tornado.web.authenticated
    async def get(self) -> None:
        found: list[SemaphoreView] = []
        error = None
        try:
            found = await IOLoop.current().run_in_executor(None, self.read)
        except SemaphoreBackendError as exc:
            self.set_status(503)
            error = str(exc)
        # The cookie a form's token must match, even on a page with no form, for scripts.
        self.xsrf_token  # noqa: B018
        namespace = self.get_template_namespace()
        namespace.update(
            url_prefix=self.application.options.url_prefix,
            semaphores=found,
            error=error,
            seconds=_seconds,
            utc=_utc,
            refresh_ms=int(REFRESH_SECONDS * 1000),
            limits_off=refusal(self.application.options, self.set_limit),
            limit_url=self.reverse_url("semaphore_limit"),
        )
        self.finish(_page(self.get_template_path()).generate(**namespace))


class SemaphoresApi(BaseApiHandler):  # type: ignore[misc]
    """``GET /api/semaphores``: a JSON list of :meth:`SemaphoreView.as_dict`; 503 on failure."""

    def initialize(self, read: Reader) -> None:
        self.read = read

    @tornado.web.authenticated
    async def get(self) -> None:
        try:
            found = await IOLoop.current().run_in_executor(None, self.read)
        except SemaphoreBackendError as exc:
            # Written here rather than raised: Flower 2.1 would write the format string.
            self.set_status(503)
            self.set_header("Content-Type", "text/plain; charset=UTF-8")
            self.finish(str(exc))
            return
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.finish(json.dumps([sem.as_dict() for sem in found], default=str))


def _seconds(value: float) -> str:
    """``12.3 s`` under a minute, else ``4m 05s`` or ``2h 03m``."""
    if value < 60:
        return f"{max(value, 0.0):.1f} s"
    minutes, secs = divmod(round(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def _utc(epoch: float) -> str:
    """``2026-12-01 18:40:02 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


@functools.lru_cache(maxsize=4)
def _page(template_path: str) -> tornado.template.Template:
    """The page's template, extending Flower's ``base.html`` from ``template_path``."""
    return tornado.template.Template(
        _PAGE, name="semaphores.html", loader=tornado.template.Loader(template_path)
    )


# Flower's base.html gives the navbar, styles and scripts; it has no hook for a navbar entry,
# so the page adds its own link to the navbar it shows (Flower's other pages do not get one).
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
        <span class="live-limit me-auto">{% if sem.live %}Live limit
          <strong>{{ sem.live.limit }}</strong>, set by {{ sem.live.by }}
          at {{ utc(sem.live.set_at) }}{% else %}No live limit: the callers' limit
          applies{% end %}</span>
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
        {% end %}{% end %}
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
</div>
{% end %}
{% block extra_scripts %}
<script>
(function () {
  var nav = document.querySelector(".app-nav, .navbar-nav");
  if (nav) {
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
        var now = done.limit === null ? "cleared" : "set to " + done.limit;
        var was = done.previous === null ? "none" : done.previous;
        message.className = "small mt-2 text-success";
        message.textContent = "Live limit of " + done.key + " " + now + " (was " + was + ").";
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
})();
</script>
{% end %}
"""
