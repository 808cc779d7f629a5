"""Run Flower with the Semaphores page for the tests, in a process of its own.

``python -m tests.flower_helper REDIS_URL [FLOWER_OPTION ...]`` runs
:func:`celery_semaphore.views.flower.start_flower` for ``tests.celery_apps.make_app(REDIS_URL)``
until SIGTERM. ``CSEM_FLOWER_SEMAPHORE_URL``, when set, points the page at another Redis (a
dead one, say) while Flower itself keeps using REDIS_URL as its broker;
``CSEM_FLOWER_SET_LIMIT=0`` sets the app's ``semaphore_flower_set_limit`` to False.
"""

from __future__ import annotations

import os
import sys

from celery_semaphore.views.flower import start_flower

from .celery_apps import make_app


def main(argv: list[str]) -> None:
    app = make_app(argv[0])
    if "CSEM_FLOWER_SEMAPHORE_URL" in os.environ:
        app.conf.semaphore_url = os.environ["CSEM_FLOWER_SEMAPHORE_URL"]
    if os.environ.get("CSEM_FLOWER_SET_LIMIT") == "0":
        app.conf.semaphore_flower_set_limit = False
    start_flower(app, argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
