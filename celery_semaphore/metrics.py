"""Prometheus metrics, at the import path the docs give them.

They live in :mod:`celery_semaphore.views.metrics`; see there for each metric.
"""

from .views.metrics import Metrics, RoomCollector, install, template_label

__all__ = ["Metrics", "RoomCollector", "install", "template_label"]
