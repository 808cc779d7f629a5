"""``celery -A proj semaphore ...``: see and manage slots from the command line.

Installed through Celery's ``celery.commands`` entry point, so it is a subcommand of the
``celery`` program and gets the app from ``-A``::

    celery -A proj semaphore status [KEY...] [--json]
    celery -A proj semaphore set-limit KEY LIMIT | set-limit KEY --clear
    celery -A proj semaphore pause KEY [--by WHO] | resume KEY [--by WHO]
    celery -A proj semaphore why TASK_ID [--json]
    celery -A proj semaphore release-all KEY [--yes]
    celery -A proj semaphore watch [KEY...] [--interval 1.0]
    celery -A proj semaphore flower [flower options]

Every view reads Redis, so it also shows slots held by a worker that has died and whose
lease has not run out yet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime

import click
import redis
from celery import Celery

from ..core.admin import SemaphoreAdmin
from ..core.handoff import HandoffRoute
from ..core.live import RateState
from ..core.rates import Rate
from ..errors import SemaphoreError
from ..integration.settings import app_settings, client_for
from ..integration.waiting_room.handoffs import publisher_for
from .inspection import SemaphoreView, views
from .why import Standing, why


def _app(ctx: click.Context) -> Celery:
    app = getattr(ctx.find_root().obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj semaphore ...`")
    return app


class _Commands(click.Group):
    """The ``semaphore`` group: a :class:`SemaphoreError` of any of its commands is said as
    click says an error (no traceback)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except SemaphoreError as exc:
            raise click.ClickException(str(exc)) from exc


WAITING_SHOWN = 5
"""Waiting runs ``status`` and ``watch`` list per key by default (their total is shown)."""


def _views(
    app: Celery, keys: tuple[str, ...], waiting: int | None = WAITING_SHOWN
) -> list[SemaphoreView]:
    settings = app_settings(app)
    # Declared keys are listed even when idle; a template ("tenant:{id}") names no key.
    declared = {name: options["limit"] for name, options in settings.declared.items()
                if isinstance(options.get("limit"), int) and "{" not in name}  # fmt: skip
    return views(client_for(app), keys or None, settings.prefix, declared, waiting)


def _seconds(value: float) -> str:
    return f"{value:.1f}s"


def _reserved(meta: Mapping[str, object]) -> str:
    """What a holder with no task is: a hand-off's reservation, or units kept for a run of
    several keys that waits for the others."""
    if "reserved_for" not in meta:
        return "-"
    return "(kept, waits for its other keys)" if meta.get("waiting") else "(handed off)"


def _when(epoch: float) -> str:
    # ISO 8601 with the UTC offset: operators on several time zones read the same moment.
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def _live(sem: SemaphoreView | Standing) -> str:
    """What status and why say of a key's live limit and pause: who set them and when."""
    said = ""
    if sem.paused is not None:
        said += f" PAUSED by {sem.paused.by} at {_when(sem.paused.paused_at)}"
    if sem.live is not None:
        said += f" (live limit {sem.live.limit}, set by {sem.live.by} at {_when(sem.live.set_at)})"
    for rate in sem.rates:
        said += f"\n  rate {rate.name}: " + _rate(rate)
    fed = sem.feedback
    if fed is not None and fed.limit is not None:
        said += f"\n  adaptive limit {fed.limit} (from {fed.min} to {fed.max})"
    if fed is not None and fed.back_offs:
        hint = "no hint" if fed.last_hint is None else f"hint {fed.last_hint:g}s"
        said += (f"\n  {'COOLING until' if fed.cooling(time.time()) else 'cooled down at'} "
                 f"{_when(fed.cooling_until)}; {fed.back_offs} back-off(s), the last by "
                 f"{fed.last_by} at {_when(fed.last_at)} ({hint})")  # fmt: skip
    return said


def _rate(rate: RateState) -> str:
    """A start rate's state, as status says it."""
    if rate.interval is None:
        said = f"next due {_when(rate.next_due)}"
    else:
        said = (f"{rate.left} of {rate.burst} free, one every {rate.interval:g}s, "
                f"next due {_when(rate.next_due)}")  # fmt: skip
    if rate.live is not None:
        said += f" (live rate {rate.live.spec}, set by {rate.live.by} at {_when(rate.live.set_at)})"
    return said


def render(semaphores: list[SemaphoreView]) -> str:
    """The text table that ``status`` and ``watch`` print."""
    if not semaphores:
        return "No slot is held."
    lines = []
    for sem in semaphores:
        if not sem.holders and not sem.waiting:
            limit = f", limit {sem.limit}" if sem.limit else ""
            lines.append(f"{sem.key}  no slot held{limit}{_live(sem)}")
            continue
        queued = (
            ""
            if sem.oldest_wait is None
            else (f", {sem.queued} queued (oldest {_seconds(sem.oldest_wait)})")
        )
        lines.append(f"{sem.key}  {sem.in_use}/{sem.limit or '?'} in use{queued}{_live(sem)}")
        rows = [("TASK ID", "TASK", "WORKER", "PID", "HELD FOR", "EXPIRES IN")]
        for holder in sem.holders:
            meta = holder.metadata
            rows.append(
                (
                    str(meta.get("task_id") or meta.get("reserved_for") or "-"),
                    str(meta.get("task_name") or _reserved(meta)),
                    str(meta.get("worker") or meta.get("host") or "-"),
                    str(meta.get("pid") or "-"),
                    _seconds(holder.held_for),
                    _seconds(holder.expires_in),
                )
            )
        lines.extend(_table(rows))
        if sem.waiting:
            shown = len(sem.waiting)
            lines.append(f"  waiting, first served first ({shown} of {sem.queued}):"
                         if shown < sem.queued else "  waiting, first served first:")  # fmt: skip
            waiting = [
                ("TASK ID", "WAITED"),
                *((w.waiter, _seconds(w.waited)) for w in sem.waiting),
            ]
            lines.extend("  " + line for line in _table(waiting))
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` as text columns, indented under their key's line."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]  # fmt: skip


@click.group(name="semaphore", cls=_Commands)
def semaphore() -> None:
    """See and manage celery-semaphore slots (reads the app's semaphore_url)."""


@semaphore.command()
@click.argument("keys", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--waiting", type=click.IntRange(min=0, max=1000), default=WAITING_SHOWN, show_default=True,
    help="Waiting runs to list per key, first served first (their total is always shown).",
)  # fmt: skip
@click.pass_context
def status(ctx: click.Context, keys: tuple[str, ...], as_json: bool, waiting: int) -> None:
    """Every semaphore (or the KEYS given): limit, slots in use, who holds them, and how
    many runs wait in its room, the oldest wait and the first of them."""
    found = _views(_app(ctx), keys, waiting)
    if as_json:
        click.echo(json.dumps([sem.as_dict() for sem in found], indent=2, sort_keys=True))
    else:
        click.echo(render(found))


@semaphore.command(name="set-limit")
@click.argument("key")
@click.argument("limit", type=click.IntRange(min=1, max=2**31 - 1), required=False)
@click.option("--clear", is_flag=True, help="Drop the live limit: the code's limit applies again.")
@click.pass_context
def set_limit_command(ctx: click.Context, key: str, limit: int | None, clear: bool) -> None:
    """Set KEY's live limit to LIMIT, in Redis, for every worker at once, with no deploy.

    It wins over the limit in the code (or app.conf.semaphores) until --clear. The next
    acquire uses it. Lowering it evicts nobody: running tasks keep their slots and new ones
    wait until the key is under the new limit. Raising it starts parked runs at once. The
    change is logged, and status shows who set it and when.
    """
    if (limit is None) == (not clear):
        raise click.UsageError("give a LIMIT, or --clear (not both)")
    previous = admin_of(_app(ctx)).set_limit(key, limit)
    was = "none" if previous is None else previous
    now = "cleared" if limit is None else f"set to {limit}"
    click.echo(f"Live limit of {key!r} {now} (was {was}).")


@semaphore.command(name="set-rate")
@click.argument("key")
@click.argument("rate", required=False)
@click.option(
    "--burst",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Units that may start at once after an idle spell.",
)
@click.option(
    "--name",
    default="requests",
    show_default=True,
    help="Which of the key's rates: the name its Rate(...) gives (tokens, ...).",
)
@click.option("--clear", is_flag=True, help="Drop the live rate: the code's rate applies again.")
@click.option("--by", default=None, help="Who sets it, for status (default: user@host pid N).")
@click.pass_context
def set_rate_command(
    ctx: click.Context, key: str, rate: str | None, burst: int, name: str, clear: bool,
    by: str | None,
) -> None:  # fmt: skip
    """Set KEY's live start rate to RATE ("300/m", "10/s"), in Redis, for every worker.

    It wins over the rate of the same name in the code (a task's rate=) until --clear; the
    next hand-off follows it. A run already handed its instant keeps it. The change is
    logged, and status shows the rate, who set it and when.
    """
    if (rate is None) == (not clear):
        raise click.UsageError("give a RATE, or --clear (not both)")
    new = None if rate is None else Rate(rate, burst=burst, name=name)
    previous = admin_of(_app(ctx)).set_rate(key, new, name=name, by=by)
    now = "cleared" if new is None else f"set to {new.spec} (burst {new.burst})"
    click.echo(f"Live {name} rate of {key!r} {now} (was {previous or 'none'}).")


def admin_of(app: Celery, client: redis.Redis | None = None) -> SemaphoreAdmin:
    """An admin of ``app``'s store (through ``client``, else the app's own) that publishes
    the hand-offs its changes make, as the app's workers would."""
    settings = app_settings(app)
    route = HandoffRoute(settings.policy.claim_timeout, publisher_for(app),
                         settings.policy.handoff_grace)  # fmt: skip
    return SemaphoreAdmin(client_for(app) if client is None else client, settings.prefix, route)


@semaphore.command()
@click.argument("key")
@click.option("--by", default=None, help="Who pauses it, for status (default: user@host pid N).")
@click.pass_context
def pause(ctx: click.Context, key: str, by: str | None) -> None:
    """Pause KEY for every worker at once: running tasks finish, nothing new starts.

    While KEY is paused its tasks park in its waiting room (on_full="queue", the default),
    or shed or fail as their on_full says (SemaphoreNotAcquiredError, reason "paused"). Its
    live limit, if any, is kept. status shows who paused it and when; `resume` undoes it.
    """
    was = admin_of(_app(ctx)).pause(key, by)
    click.echo(f"{key!r} was paused already." if was else f"Paused {key!r}.")


@semaphore.command()
@click.argument("key")
@click.option("--by", default=None, help="Who resumes it, for the log (default: user@host pid N).")
@click.pass_context
def resume(ctx: click.Context, key: str, by: str | None) -> None:
    """Resume KEY after `pause`: its free slots go to the oldest parked runs at once."""
    was = admin_of(_app(ctx)).resume(key, by)
    click.echo(f"Resumed {key!r}." if was else f"{key!r} was not paused: nothing to resume.")


@semaphore.command(name="why")
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def why_command(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Why is TASK_ID waiting: the rooms it is parked in, its place in each, the holders ahead
    of it, the limit in force (live limit, pause) and its wait budget left.

    It exits with 1 when the task is in no waiting room and holds no slot (its result
    backend's state is shown then: it may have ended, or not have arrived yet).
    """
    app = _app(ctx)
    found = why(client_for(app), task_id, app_settings(app).prefix)
    state = None if found else str(app.AsyncResult(task_id).state)
    if as_json:
        click.echo(json.dumps({"task_id": task_id, "standings": [s.as_dict() for s in found],
                               "result_state": state}, indent=2, sort_keys=True))  # fmt: skip
    else:
        click.echo(render_why(task_id, found, state))
    if not found:
        ctx.exit(1)


def _where(s: Standing) -> str:
    if s.state == "reserved":
        return f"handed a slot, its message on the way (the slot waits {s.reserved_for:.1f}s more)"
    if s.state == "passive":
        return "parked, letting this key serve others first (it needs others too)"
    if s.state == "holding":
        return "holds a slot: its body runs"
    return f"parked, {s.position} of {s.queued} in line"


def render_why(task_id: str, found: Sequence[Standing], state: str | None) -> str:
    """The text ``why`` prints for ``found`` (``state``: the result backend's, when empty)."""
    if not found:
        return (f"Task {task_id} is in no waiting room and holds no slot "
                f"(its result backend says {state}).")  # fmt: skip
    lines = [f"Task {task_id}:"]
    for s in found:
        waited = "" if s.waited is None else f", waiting {s.waited:.1f}s"
        budget = "" if s.gives_up_in is None else f"; gives up in {max(0.0, s.gives_up_in):.1f}s"
        lines.append(f"  {s.key!r}: {_where(s)}{waited}{budget}")
        lines.append(f"    limit {s.limit if s.limit is not None else '?'} in force{_live(s)}")
        held = [f"task {h.metadata.get('task_id') or h.token} on {h.metadata.get('host', '?')} "
                f"(held {h.held_for:.1f}s, lease ends in {h.expires_in:.1f}s)"
                for h in s.holders[:5]]  # fmt: skip
        more = f" and {len(s.holders) - 5} more" if len(s.holders) > 5 else ""
        lines.append(f"    {len(s.holders)} holder(s): " + ("; ".join(held) or "none") + more)
    return "\n".join(lines)


@semaphore.command(name="release-all")
@click.argument("key")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release_all_command(ctx: click.Context, key: str, yes: bool) -> None:
    """Free every slot of KEY, for runs that are stuck or gone.

    A displaced run that is still alive learns of it at its next renewal: its task then fails
    with SemaphoreLeaseLostError even if its body returns, or runs again when the task has
    on_lease_lost="retry" (with interrupt=True the body is stopped at once).
    """
    app = _app(ctx)
    [sem] = _views(app, (key,))
    click.echo(render([sem]))
    if not sem.holders:
        return
    if not yes:
        click.confirm(f"Free all {sem.in_use} slot(s) of {key!r}?", abort=True)
    displaced = admin_of(app).force_release_all(key)
    click.echo(f"Released {key!r}: {displaced} live holder(s) displaced.")


@semaphore.command()
@click.argument("keys", nargs=-1)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option(
    "--count", type=click.IntRange(min=1), default=None, help="Stop after this many refreshes."
)
@click.pass_context
def watch(ctx: click.Context, keys: tuple[str, ...], interval: float, count: int | None) -> None:
    """A live view of `status`, refreshed every --interval seconds (Ctrl-C stops)."""
    app = _app(ctx)
    shown = 0
    try:
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            click.clear()
            click.echo(time.strftime("%H:%M:%S") + "\n" + render(_views(app, keys)))
            shown += 1
    except KeyboardInterrupt:
        pass


@semaphore.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def flower(ctx: click.Context) -> None:
    """Start Flower with an added Semaphores page (/semaphores, /api/semaphores)."""
    from .flower import start_flower

    start_flower(_app(ctx), list(ctx.args))
