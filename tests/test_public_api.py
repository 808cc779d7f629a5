"""The public API users rely on: every exported name and the public members of every
exported class, checked against a literal list, and the deprecated spellings of 0.1.0, each
still working (with a DeprecationWarning naming its new spelling) until 0.3.0.

A change to the surface fails :func:`test_the_public_surface_is_the_listed_one` until
:data:`SURFACE` and CHANGELOG.md say it on purpose.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import celery_semaphore
from celery_semaphore import Semaphore, SemaphoreAdmin, Slot
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.core.group import SlotGroup
from celery_semaphore.core.replies import NotWaiting, Parked
from celery_semaphore.testing import RedisServer

MODULES = ["celery_semaphore", "celery_semaphore.asyncio", "celery_semaphore.core"]

SURFACE: dict[str, list[str]] = {
    "celery_semaphore": [
        "Adaptive",
        "BackOff",
        "Holder",
        "LeaseInterrupted",
        "Rate",
        "Refusal",
        "Semaphore",
        "SemaphoreAdmin",
        "SemaphoreBackendError",
        "SemaphoreError",
        "SemaphoreLeaseLostError",
        "SemaphoreNotAcquiredError",
        "SemaphoreRunLostError",
        "SemaphoreTask",
        "SemaphoreValidationError",
        "Slot",
        "WaitingRoom",
        "bounded",
        "current_slot",
    ],
    "celery_semaphore.Adaptive": ["initial", "max", "min", "spec"],
    "celery_semaphore.BackOff": ["from_error", "key", "retry_after"],
    "celery_semaphore.asyncio": [
        "AsyncSemaphore",
        "AsyncSemaphoreAdmin",
        "AsyncSlot",
        "AsyncSlotGroup",
        "async_client_from_url",
        "async_client_like",
    ],
    "celery_semaphore.core": [
        "Adaptive",
        "BackOff",
        "DEFAULT_LEASE",
        "DEFAULT_PREFIX",
        "HandoffRoute",
        "Holder",
        "Rate",
        "Semaphore",
        "SemaphoreAdmin",
        "Slot",
        "WaitingRoom",
        "client_from_url",
        "guard",
    ],
    "celery_semaphore.Holder": [
        "acquired_at",
        "expires_at",
        "expires_in",
        "held_for",
        "metadata",
        "token",
    ],
    "celery_semaphore.LeaseInterrupted": ["key", "limit", "message"],
    "celery_semaphore.Rate": ["burst", "interval_ms", "lua", "name", "spec", "units"],
    "celery_semaphore.Refusal": [
        "BACKEND",
        "BACK_OFF",
        "FULL",
        "PAUSED",
        "ROOM_FULL",
        "SHUTDOWN",
        "TIMEOUT",
    ],
    "celery_semaphore.Semaphore": [
        "acquire",
        "acquire_many",
        "admin",
        "available",
        "claim",
        "claim_many",
        "client",
        "close",
        "count",
        "force_release",
        "force_release_all",
        "handoffs",
        "hold",
        "hold_many",
        "holders",
        "lease",
        "limit",
        "names",
        "park",
        "park_many",
        "prefix",
        "rates",
        "room",
        "run",
        "set_limit",
    ],
    "celery_semaphore.SemaphoreAdmin": [
        "cancel",
        "client",
        "feedback",
        "force_release",
        "force_release_all",
        "handoffs",
        "holders",
        "keys_of",
        "live_limit",
        "names",
        "pause",
        "pause_of",
        "prefix",
        "resume",
        "room",
        "room_head",
        "scan_keys",
        "server_warnings",
        "set_limit",
        "set_rate",
        "sweep",
    ],
    "celery_semaphore.SemaphoreBackendError": ["key", "limit", "message"],
    "celery_semaphore.SemaphoreError": ["key", "limit", "message"],
    "celery_semaphore.SemaphoreLeaseLostError": ["key", "limit", "message"],
    "celery_semaphore.SemaphoreNotAcquiredError": ["args", "key", "limit", "message", "reason"],
    "celery_semaphore.SemaphoreRunLostError": ["key", "limit", "message"],
    "celery_semaphore.SemaphoreTask": [
        "abstract",
        "back_off_on",
        "claim_timeout",
        "fair_by",
        "handoff_grace",
        "head_start",
        "heartbeat",
        "interrupt",
        "lease",
        "limit",
        "max_back_offs",
        "max_cool_down",
        "max_queued",
        "on_bound",
        "on_full",
        "on_lease_lost",
        "queue_timeout",
        "rate",
        "semaphore",
        "shed_backoff",
        "shed_countdown",
        "shed_max_countdown",
        "shed_max_retries",
        "shed_timeout",
        "wait_timeout",
        "weight",
    ],
    "celery_semaphore.SemaphoreValidationError": ["key", "limit", "message"],
    "celery_semaphore.Slot": [
        "acquired_at",
        "back_off",
        "cooling_until",
        "deadline",
        "expires_at",
        "extend",
        "is_held",
        "key",
        "lease",
        "lease_lost_error",
        "limit",
        "lost",
        "release",
        "released",
        "token",
        "weight",
        "when_lost",
    ],
    "celery_semaphore.WaitingRoom": [
        "cancel",
        "claim",
        "claim_many",
        "client",
        "handoffs",
        "head",
        "index",
        "lease",
        "limit",
        "names",
        "outlives",
        "park",
        "park_many",
        "sweep",
        "sweep_many",
        "waiters",
    ],
    "celery_semaphore.asyncio.AsyncSemaphore": [
        "aclose",
        "acquire",
        "acquire_many",
        "admin",
        "available",
        "client",
        "count",
        "force_release_all",
        "handoffs",
        "hold",
        "hold_many",
        "holders",
        "lease",
        "limit",
        "live_limit",
        "names",
        "prefix",
        "rates",
        "run",
        "set_limit",
    ],
    "celery_semaphore.asyncio.AsyncSemaphoreAdmin": [
        "client",
        "feedback",
        "force_release",
        "force_release_all",
        "handoffs",
        "holders",
        "keys_of",
        "live_limit",
        "names",
        "pause",
        "pause_of",
        "prefix",
        "resume",
        "scan_keys",
        "server_warnings",
        "set_limit",
        "set_rate",
    ],
    "celery_semaphore.asyncio.AsyncSlot": [
        "acquired_at",
        "back_off",
        "cooling_until",
        "deadline",
        "expires_at",
        "extend",
        "is_held",
        "key",
        "lease",
        "lease_lost_error",
        "limit",
        "lost",
        "release",
        "released",
        "token",
        "weight",
        "when_lost",
    ],
    "celery_semaphore.asyncio.AsyncSlotGroup": [
        "back_off",
        "extend",
        "is_held",
        "key",
        "keys",
        "lease",
        "lease_lost_error",
        "limit",
        "lost",
        "release",
        "slots",
        "token",
        "weight",
        "when_lost",
    ],
    "celery_semaphore.core.HandoffRoute": [
        "adaptive",
        "claim_ms",
        "deliver",
        "gather",
        "grace_ms",
        "mark_before",
        "max_cool_down_ms",
        "publish",
        "publisher",
        "release_claim_ms",
    ],
    "celery_semaphore.core.guard": ["interval", "on_renew_error", "slot"],
}
"""Each module's ``__all__``, then the public members (methods, properties, class and
instance attributes) of each class it exports, under the first module that exports it."""

DEPRECATED = {
    "Semaphore": {
        "force_release": "sem.admin.force_release",
        "force_release_all": "sem.admin.force_release_all",
        "holders": "sem.admin.holders",
        "set_limit": "sem.admin.set_limit",
        "park": "sem.room.park",
        "claim": "sem.room.claim",
        "park_many": "sem.room.park_many",
        "claim_many": "sem.room.claim_many",
    },
    "AsyncSemaphore": {
        "force_release_all": "sem.admin.force_release_all",
        "holders": "sem.admin.holders",
        "set_limit": "sem.admin.set_limit",
        "live_limit": "sem.admin.live_limit",
    },
    "SemaphoreAdmin": {
        "room": "sem.room.waiters",
        "room_head": "sem.room.head",
        "sweep": "sem.room.sweep",
        "cancel": "sem.room.cancel",
    },
}
"""The 0.1.0 spellings kept for 0.2.x (removed in 0.3.0), and their new spellings."""


def _members(cls: type) -> list[str]:
    """The public members of ``cls`` the package defines: names in the class bodies of its
    package bases, their annotations, and the ``self.<name>`` they assign."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("celery_semaphore"):
            continue
        names |= {*vars(base), *getattr(base, "__annotations__", {})}
        tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        names |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"
        }  # fmt: skip
    return sorted(name for name in names if not name.startswith("_"))


def _surface() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in MODULES:
        found[name] = sorted(importlib.import_module(name).__all__)
    seen: set[type] = set()
    for name in MODULES:
        module = importlib.import_module(name)
        for export in sorted(module.__all__):
            obj = getattr(module, export)
            if inspect.isclass(obj) and obj not in seen:
                seen.add(obj)
                found[f"{name}.{export}"] = _members(obj)
    return found


def test_the_public_surface_is_the_listed_one() -> None:
    found = _surface()
    for name in SURFACE.keys() | found.keys():
        expected, actual = set(SURFACE.get(name, [])), set(found.get(name, []))
        assert actual == expected, (
            f"{name}: added {sorted(actual - expected)}, removed {sorted(expected - actual)}: "
            "update SURFACE and say it in CHANGELOG.md"
        )


def test_every_deprecated_spelling_is_listed_and_marked() -> None:
    classes = {"Semaphore": Semaphore, "AsyncSemaphore": AsyncSemaphore,
               "SemaphoreAdmin": SemaphoreAdmin}  # fmt: skip
    for name, aliases in DEPRECATED.items():
        for old, new in aliases.items():
            alias = getattr(classes[name], old)
            assert alias.__deprecated__ == new
            assert "removed in 0.3.0" in alias.__doc__
    marked = {
        (name, member)
        for name, cls in classes.items()
        for member in dir(cls)
        if hasattr(getattr(cls, member), "__deprecated__")
    }
    assert marked == {(name, old) for name, aliases in DEPRECATED.items() for old in aliases}


def test_the_version_is_the_distribution_s_and_the_changelog_names_it() -> None:
    root = Path(__file__).parent.parent
    declared = re.search(r'^version = "(.+)"$', (root / "pyproject.toml").read_text(), re.M)
    assert declared is not None
    assert celery_semaphore.__version__ == declared[1]
    changelog = (root / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(declared[1])}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M)


def old(call: Callable[[], Any], new: str) -> Any:
    """What ``call`` of a deprecated spelling answers, checking it warned once, naming
    ``new``, and pointed the warning at the caller's line."""
    with pytest.warns(DeprecationWarning, match=re.escape(f"use {new}")) as warned:
        answer = call()
    assert [w.filename for w in warned] == [__file__]
    return answer


def test_the_deprecated_semaphore_spellings_warn_and_still_work(
    redis_server: RedisServer,
) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    slot = sem.acquire("k")
    assert slot is not None
    assert [h.token for h in old(lambda: sem.holders("k"), "sem.admin.holders")] == [slot.token]
    assert old(lambda: sem.force_release("k", slot.token), "sem.admin.force_release") is True
    assert old(lambda: sem.set_limit("k", 2, by="ops"), "sem.admin.set_limit") is None
    assert sem.admin.live_limit("k").limit == 2  # type: ignore[union-attr]
    assert [sem.acquire("k") is not None for _ in range(2)] == [True, True]
    assert old(lambda: sem.force_release_all("k"), "sem.admin.force_release_all") == 2

    held = sem.acquire("room")
    assert held is not None
    parked = old(lambda: sem.park("room", "w1", b"run w1"), "sem.room.park")
    assert isinstance(parked, Parked)
    assert parked.position == 0
    assert held.release() is True  # reserves the slot for w1
    claimed = old(lambda: sem.claim("room", "w1"), "sem.room.claim")
    assert isinstance(claimed, Slot)
    assert claimed.release() is True

    keys = [("a", 1), ("b", 1)]
    group = old(lambda: sem.park_many(keys, "w2", b"run w2"), "sem.room.park_many")
    assert isinstance(group, SlotGroup)
    group.release()
    assert isinstance(old(lambda: sem.claim_many(keys, "w2"), "sem.room.claim_many"), NotWaiting)
    sem.close()


def test_the_deprecated_admin_spellings_warn_and_still_work(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    admin = SemaphoreAdmin(sem.client)
    held = sem.acquire("k")
    assert held is not None
    assert isinstance(sem.room.park("k", "w1", b"run w1"), Parked)
    assert isinstance(sem.room.park("k", "w2", b"run w2"), Parked)
    assert [w.waiter for w in old(lambda: admin.room("k"), "sem.room.waiters")] == ["w1", "w2"]
    count, head = old(lambda: admin.room_head("k"), "sem.room.head")
    assert (count, head.waiter) == (2, "w1")
    assert old(lambda: admin.cancel("k", "w1"), "sem.room.cancel") is True
    assert sem.room.waiters("k")[0].waiter == "w2"
    assert old(lambda: admin.sweep("k"), "sem.room.sweep") == 0  # the slot is still held
    assert held.release() is True
    sem.close()


def test_the_deprecated_asyncio_spellings_warn_and_still_work(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            slot = await sem.acquire("k")
            assert slot is not None
            holders = await old(lambda: sem.holders("k"), "sem.admin.holders")
            assert [h.token for h in holders] == [slot.token]
            assert await old(lambda: sem.set_limit("k", 3), "sem.admin.set_limit") is None
            live = await old(lambda: sem.live_limit("k"), "sem.admin.live_limit")
            assert live.limit == 3
            displaced = await old(lambda: sem.force_release_all("k"), "sem.admin.force_release_all")
            assert displaced == 1

    asyncio.run(main())
