"""``acquire(wait=...)``: block until a release frees a slot, without polling.

A caller that found its key full registers its token as blocked (``block.lua``) and then
blocks on the key's wake list (BLPOP). A release that frees a slot the waiting room does not
take pushes one element there (``release.lua``), which wakes one blocked caller to try again.
Each block also ends at the soonest lease to lapse (a crashed holder frees its slot then,
and nobody pushes) and after :data:`MAX_BLOCK` seconds. Sync and asyncio callers block on
one list, so a release by either wakes either: the sync wait is ``Semaphore.acquire``'s, the
asyncio one :meth:`Acquirer.wait <celery_semaphore.asyncio.acquiring.Acquirer.wait>`.
"""

from __future__ import annotations

MAX_BLOCK = 2.0
"""Longest single BLPOP, seconds: under the 5 s socket timeout of clients made from a URL."""
