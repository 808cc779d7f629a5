"""The Semaphores page in the ``celery flower`` you already run: import this module from
Flower's config file, ``flowerconfig.py`` in the directory Flower starts in (or the file
``--conf`` names)::

    import celery_semaphore.flower  # noqa: F401

Flower runs that file as Python before it builds its application, so the import adds
``/semaphores``, its JSON API and a navbar link (see
:func:`celery_semaphore.views.flower.install`). Needs Flower 2.1 or later
(``pip install 'celery-semaphore[flower]'``).
"""

from .views.flower import install

install()

__all__ = ["install"]
