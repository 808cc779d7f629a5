"""The Semaphores page's HTML, and the link to it in Flower's navbar.

The page extends Flower's own ``base.html`` (navbar, styles, scripts) and re-reads itself
every few seconds (see :mod:`celery_semaphore.views.flower` for its routes). Flower's
templates have no hook for a navbar entry, but they draw the navbar through tornado's
``Template`` UI module: :class:`NavbarWithSemaphores` stands in for that module and adds a
"Semaphores" link to the first list of the navbar, on every Flower page.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import tornado.escape
import tornado.template
import tornado.web


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
