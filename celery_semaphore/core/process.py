"""What identifies this process's holders, kept current across a fork without a system call
on the hot path: its pid, and a token unique to each acquisition.

A token is a per-process counter (hex) followed by a random 64-bit suffix drawn once per
process, so making one is an integer increment and a string format. After a fork
(``os.register_at_fork``) the child reads its pid again and draws a new suffix, as it would
otherwise repeat its parent's tokens. Two tokens are equal only if their suffixes are (the
suffix has a fixed length at the end), which for two processes is a 1 in 2**64 chance.
Tokens are not ordered and not secret: they identify a holder, they do not authorize one.
"""

from __future__ import annotations

import itertools
import os
import secrets


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
