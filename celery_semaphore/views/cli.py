"""``celery -A proj semaphore ...``: see and manage slots from the command line.

Installed through Celery's ``celery.commands`` entry point, so it is a subcommand of the
``celery`` program and gets the app from ``-A``::

    celery -A proj semaphore status [KEY...] [--json]
    celery -A proj semaphore set-limit KEY LIMIT | set-limit KEY --clear
    celery -A proj semaphore release-all KEY [--yes]
    celery -A proj semaphore watch [KEY...] [--interval 1.0]
    celery -A proj semaphore flower [flower options]

Every view reads Redis, so it also shows slots held by a worker that has died and whose
lease has not run out yet.
"""

from __future__ import annotations

import json
import time

import click
from celery import Celery

from ..core.admin import SemaphoreAdmin
from ..core.room import HandoffRoute
from ..errors import SemaphoreError
from ..integration.room import publisher_for
from ..integration.settings import app_settings, client_for
from .inspection import SemaphoreView, views


def _app(ctx: click.Context) -> Celery:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj semaphore ...`")
    return app


def _views(app: Celery, keys: tuple[str, ...]) -> list[SemaphoreView]:
    try:
        settings = app_settings(app)
        # Declared keys are listed even when idle; a template ("tenant:{id}") names no key.
        declared = {name: options["limit"] for name, options in settings.declared.items()
                    if isinstance(options.get("limit"), int) and "{" not in name}  # fmt: skip
        return views(client_for(app), keys or None, settings.prefix, declared)
    except SemaphoreError as exc:
        raise click.ClickException(str(exc)) from exc


def _seconds(value: float) -> str:
    return f"{value:.1f}s"


def _live(sem: SemaphoreView) -> str:
    """What status says of a key's live limit: its value, who set it and when."""
    if sem.live is None:
        return ""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sem.live.set_at))
    return f" (live limit {sem.live.limit}, set by {sem.live.by} at {when})"


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
        queued = ""
        if sem.oldest_wait is not None:
            queued = f", {sem.queued} queued (oldest {_seconds(sem.oldest_wait)})"
        lines.append(f"{sem.key}  {sem.in_use}/{sem.limit or '?'} in use{queued}{_live(sem)}")
        rows = [("TASK ID", "TASK", "WORKER", "PID", "HELD FOR", "EXPIRES IN")]
        for holder in sem.holders:
            meta = holder.metadata
            rows.append(
                (
                    str(meta.get("task_id") or meta.get("reserved_for") or "-"),
                    str(
                        meta.get("task_name") or ("(handed off)" if "reserved_for" in meta else "-")
                    ),
                    str(meta.get("worker") or meta.get("host") or "-"),
                    str(meta.get("pid") or "-"),
                    _seconds(holder.held_for),
                    _seconds(holder.expires_in),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines.extend(
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows
        )
    return "\n".join(lines)


@click.group(name="semaphore")
def semaphore() -> None:
    """See and manage celery-semaphore slots (reads the app's semaphore_url)."""


@semaphore.command()
@click.argument("keys", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def status(ctx: click.Context, keys: tuple[str, ...], as_json: bool) -> None:
    """Every semaphore (or the KEYS given): limit, slots in use, and who holds them."""
    found = _views(_app(ctx), keys)
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
    app = _app(ctx)
    try:
        settings = app_settings(app)
        route = HandoffRoute(settings.policy.claim_timeout, publisher_for(app),
                             settings.policy.handoff_grace)  # fmt: skip
        admin = SemaphoreAdmin(client_for(app), settings.prefix, route)
        previous = admin.set_limit(key, limit)
    except SemaphoreError as exc:
        raise click.ClickException(str(exc)) from exc
    was = "none" if previous is None else previous
    now = "cleared" if limit is None else f"set to {limit}"
    click.echo(f"Live limit of {key!r} {now} (was {was}).")


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
    try:
        admin = SemaphoreAdmin(client_for(app), app_settings(app).prefix)
        displaced = admin.force_release_all(key)
    except SemaphoreError as exc:
        raise click.ClickException(str(exc)) from exc
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
