"""The public API users rely on: every exported name and the public members of every
exported class, checked against a literal list, and the deprecated spellings of 0.1.0, each
still working (with a DeprecationWarning naming its new spelling) until 0.3.0.

A change to the surface fails :func:`test_the_public_surface_is_the_listed_one` until
:data:`SURFACE` and CHANGELOG.md say it on purpose.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import celery_semaphore
from celery_semaphore import Semaphore, SemaphoreAdmin
from celery_semaphore.asyncio import AsyncSemaphore

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
        "client",
        "close",
        "count",
        "handoffs",
        "hold",
        "hold_many",
        "lease",
        "limit",
        "names",
        "prefix",
        "rates",
        "room",
        "run",
    ],
    "celery_semaphore.SemaphoreAdmin": [
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
        "handoffs",
        "hold",
        "hold_many",
        "lease",
        "limit",
        "names",
        "prefix",
        "rates",
        "run",
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
    "celery_semaphore.core.guard": ["interval", "later", "on_renew_error", "slot"],
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
"""The 0.1.0 spellings kept for 0.2.x, deprecated there and removed in 0.3.0, and their new
spellings."""


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


def test_the_spellings_deprecated_in_0_2_0_are_gone_and_the_changelog_says_so() -> None:
    classes = {"Semaphore": Semaphore, "AsyncSemaphore": AsyncSemaphore,
               "SemaphoreAdmin": SemaphoreAdmin}  # fmt: skip
    removed = (Path(__file__).parent.parent / "CHANGELOG.md").read_text().split("## [0.2.0]")[0]
    for name, aliases in DEPRECATED.items():
        for old in aliases:
            assert not hasattr(classes[name], old), f"{name}.{old}"
            assert f"`{name}.{old}`" in removed or f"`{old}`" in removed, f"{name}.{old}"


def test_the_version_is_the_distribution_s_and_the_changelog_names_it() -> None:
    root = Path(__file__).parent.parent
    declared = re.search(r'^version = "(.+)"$', (root / "pyproject.toml").read_text(), re.M)
    assert declared is not None
    assert celery_semaphore.__version__ == declared[1]
    changelog = (root / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(declared[1])}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M)
