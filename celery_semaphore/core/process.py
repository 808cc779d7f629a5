"""What identifies this process's holders, kept current across a fork without a system call
on the hot path: its pid, and a token unique to each acquisition.

A token is a per-process counter (hex) followed by a random 64-bit suffix drawn once per
process, so making one is an integer increment and a string format. After a fork
(``os.register_at_fork``) the child reads its pid again and draws a new suffix, as it would
otherwise repeat its parent's tokens. Two tokens are equal only if their suffixes are (the
suffix has a fixed length at the end), which for two processes is a 1 in 2**64 chance.
Tokens are not ordered and not secret: they identify a holder, they do not authorize one.

A holder taken by a plain acquire is known to the store by its *member*, the token with the
holder's record after it (``<token>|<acquired_at_ms>|<metadata JSON>``, see
:func:`member_of`), so that taking and giving back a slot writes one key, not two.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import time
from collections.abc import Iterable


class _Process:
    """The pid, the token suffix and the token counter of this process."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Read the pid, draw a new suffix and count from 1 (in a fresh or forked process)."""
        self.pid = os.getpid()
        self._suffix = secrets.token_hex(8)
        self._counter = itertools.count(1)

    def token(self) -> str:
        """A new token: ``<counter, hex><16 random hex digits>``."""
        return f"{next(self._counter):x}{self._suffix}"


_THIS = _Process()
os.register_at_fork(after_in_child=_THIS.reset)


def new_token() -> str:
    """A token no other acquisition of any process is given (see the module's docstring)."""
    return _THIS.token()


def pid() -> int:
    """This process's id, as ``os.getpid()`` but without the system call each time."""
    return _THIS.pid


def member_of(info: str) -> str:
    """A new holder's member: a new token, then ``|``, then its record as holders.lua reads
    it: when it was taken (epoch ms, this host's clock) and ``info``, the holder's metadata
    JSON. The token is what views show and an operator force-releases by; the store finds
    the record in the member, with no hash field to write on acquire and delete on release.
    """
    return f"{_THIS.token()}|{int(time.time() * 1000)}|{info}"


def token_of(member: str) -> str:
    """The token a member (:func:`member_of`) starts with; a bare token stays as it is."""
    return member.partition("|")[0]


def member_pattern(token: str) -> str:
    """The ``ZSCAN MATCH`` pattern of the members that start with ``token`` (for an operator
    who names a holder by the token the views show), glob characters escaped: the holder's
    member and, for a weight above 1, its further units (see :func:`holder_member`)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", token) + "|*"


def holder_member(token: str, members: Iterable[str]) -> str:
    """The member that ``token`` names, among ``members`` (the answer to a ``ZSCAN`` with
    :func:`member_pattern`), skipping a weighted holder's further units
    (``<member>#<i>``: a record's JSON never ends in ``#`` and digits); ``token`` itself
    when none is (a bare token, a reservation, or a holder already gone)."""
    return next((m for m in members if _UNIT.search(m) is None), token)


_UNIT = re.compile(r"#\d+$")
