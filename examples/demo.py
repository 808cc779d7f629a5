"""Demo: a burst of tasks against a provider that allows LIMIT calls at once, and no 429s.

Starts Redis (a private server unless REDIS_URL is set), starts a real prefork worker with
more processes than the limit, sends a burst of bounded tasks, shows live progress, and ends
with a summary: peak in flight, 429s, runs that waited in the waiting room, and time taken
against the ideal.

    python examples/demo.py --tasks 60 --limit 5 --duration 0.5
    python examples/demo.py --unbounded      # the same burst with no semaphore: 429s
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import redis
from celery import Celery
from redis_url import redis_url
from rich.console import Console
from rich.live import Live
from rich.table import Table

from celery_semaphore import WaitingRoom

HERE = Path(__file__).resolve().parent
console = Console()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=60, help="tasks to send (default 60)")
    parser.add_argument("--limit", type=int, default=5, help="semaphore limit (default 5)")
    parser.add_argument(
        "--duration", type=float, default=0.5, help="seconds per provider call (default 0.5)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="worker processes (default 2 x limit + 2)"
    )
    parser.add_argument(
        "--unbounded", action="store_true", help="send the task that has no semaphore"
    )
    args = parser.parse_args()
    for flag, value, least in [("--tasks", args.tasks, 1), ("--limit", args.limit, 1),
                               ("--duration", args.duration, 0)]:  # fmt: skip
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if args.concurrency is None:
        args.concurrency = 2 * args.limit + 2
    elif args.concurrency < 1:
        parser.error(f"--concurrency must be >= 1, got {args.concurrency}")
    return args


def start_worker(url: str, args: argparse.Namespace, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DEMO_REDIS_URL": url,
        "DEMO_LIMIT": str(args.limit),
        "DEMO_PROVIDER_CAP": str(args.limit),
    }
    command = [sys.executable, "-m", "celery", "-A", "provider_app", "worker",
               "-P", "prefork", "-c", str(args.concurrency), "-n", f"demo@{socket.gethostname()}",
               "--loglevel=WARNING", "--without-gossip", "--without-mingle"]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(app: Celery, worker: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            sys.exit(f"worker exited with {worker.returncode}:\n{log.read_text()}")
        if app.control.ping(timeout=0.5):
            return
    sys.exit(f"worker did not start in time:\n{log.read_text()}")


def progress(
    client: redis.Redis, room: WaitingRoom, args: argparse.Namespace, started: float
) -> Table:
    def number(key: str) -> int:
        return int(client.get(key) or 0)

    inflight = number("demo:provider:inflight")
    table = Table(title="celery-semaphore demo", show_header=False)
    table.add_row("in flight / limit", f"{inflight} / {args.limit}  " + "#" * inflight)
    if not args.unbounded:
        table.add_row("waiting in the room", str(room.head("provider")[0]))
    table.add_row("done", f"{number('demo:done')} / {args.tasks}")
    table.add_row("429s", str(number("demo:provider:429")))
    table.add_row("elapsed", f"{time.monotonic() - started:.1f}s")
    return table


def main() -> int:
    args = parse_args()
    with ExitStack() as stack:
        url = redis_url(stack)
        if not os.environ.get("REDIS_URL"):
            console.print(f"Started a private redis-server at {url}")
        os.environ["DEMO_REDIS_URL"] = url
        os.environ["DEMO_LIMIT"] = str(args.limit)
        sys.path.insert(0, str(HERE))
        import provider_app

        client = redis.Redis.from_url(url)
        client.delete(*provider_app.PROVIDER_KEYS, *provider_app.COUNTER_KEYS)
        room = WaitingRoom(client, prefix=provider_app.app.conf.semaphore_prefix)
        log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "worker.log"
        console.print(
            f"Starting a prefork worker with {args.concurrency} processes (limit {args.limit})…"
        )
        worker = start_worker(url, args, log)
        stack.callback(_stop, worker)
        wait_ready(provider_app.app, worker, log)

        task = provider_app.call_model_unbounded if args.unbounded else provider_app.call_model
        started = time.monotonic()
        results = [task.delay(n, args.duration) for n in range(args.tasks)]
        # AsyncResult.__del__ talks to Redis: drop them all before the private server stops.
        stack.callback(gc.collect)
        stack.callback(results.clear)
        try:
            with Live(
                progress(client, room, args, started), console=console, refresh_per_second=8
            ) as live:
                while not all(r.ready() for r in results):
                    live.update(progress(client, room, args, started))
                    time.sleep(0.1)
                live.update(progress(client, room, args, started))
        except KeyboardInterrupt:
            console.print("Interrupted: stopping the worker.")
            return 130
        elapsed = time.monotonic() - started
        failed = [r for r in results if not r.successful()]
        values = [r.result for r in results if r.successful()]
        rejected = sum(1 for v in values if v["status"] == 429)

        peak = int(client.get("demo:provider:peak") or 0)
        errors = int(client.get("demo:provider:429") or 0)
        parked = int(client.get(provider_app.PARKED_KEY) or 0)
        handoffs = int(client.get(provider_app.HANDOFFS_KEY) or 0)
        sheds = int(client.get(provider_app.SHEDS_KEY) or 0)
        ideal = args.tasks * args.duration / args.limit
        summary = Table(title="Summary", show_header=False)
        summary.add_row("tasks", f"{len(values) - rejected} served, {rejected} refused with 429, "
                        f"{len(failed)} failed")  # fmt: skip
        summary.add_row("peak in flight at the provider", f"{peak} (its cap: {args.limit})")
        summary.add_row("429s from the provider", str(errors))
        if not args.unbounded:
            summary.add_row("waiting room", f"{parked} parked, {handoffs} started by a hand-off")
        if sheds:
            summary.add_row("shed with a countdown", str(sheds))
        if not args.unbounded:
            summary.add_row(
                "time", f"{elapsed:.1f}s (ideal {ideal:.1f}s = tasks x duration / limit)"
            )
        console.print()
        console.print(summary)
        ok = not failed and errors == 0 and peak <= args.limit
        if args.unbounded:
            console.print(
                f"Unbounded run: {errors} calls were refused, since the provider saw every "
                "worker process at once. Run without --unbounded to see the semaphore."
            )
            return 0
        console.print("[green]OK: no 429s[/green]" if ok else "[red]FAILED[/red]")
        return 0 if ok else 1


def _stop(worker: subprocess.Popen[bytes]) -> None:
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


if __name__ == "__main__":
    sys.exit(main())
