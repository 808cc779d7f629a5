"""The tests' Celery app as a module ``celery -A`` can load, for a plain ``celery flower``:
``CSEM_FLOWER_REDIS_URL`` names its Redis (broker, backend and semaphores)."""

from __future__ import annotations

import os

from .celery_apps import make_app

app = make_app(os.environ["CSEM_FLOWER_REDIS_URL"])
