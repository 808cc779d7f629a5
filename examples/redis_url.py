"""The Redis the examples use: ``REDIS_URL`` if set (checked with one PING), else a private
``redis-server`` started for the run."""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack

import redis

from celery_semaphore.testing import RedisServer


def redis_url(stack: ExitStack) -> str:
    """``REDIS_URL``, or the URL of a private server that ``stack`` stops.

    Exits (status 1) with one line saying what to fix when ``REDIS_URL`` cannot be reached.
    """
    url = os.environ.get("REDIS_URL")
    if not url:
        return stack.enter_context(RedisServer()).url
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3) as client:
            client.ping()
    except (redis.RedisError, ValueError) as exc:
        sys.exit(f"cannot use REDIS_URL={url!r} ({exc}); fix it, or unset it to start a private "
                 "redis-server")  # fmt: skip
    return url
