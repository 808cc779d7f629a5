"""Holder tokens: unique to each acquisition across processes and hosts, and cheap to make.

A token is a per-process counter (hex) followed by a random 64-bit prefix drawn once per
process, so making one is an integer increment and a string format, with no system call.
The prefix is drawn again in a forked child (``os.register_at_fork``), which would otherwise
repeat its parent's tokens. Two tokens are equal only if their prefixes are (the prefix has a
fixed length at the end), which for two processes is a 1 in 2**64 chance. Tokens are not
ordered and not secret: they identify a holder, they do not authorize one.
"""

from __future__ import annotations

import itertools
import os
import secrets


class _TokenSource:
    """The process's prefix and counter."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Draw a new prefix and start counting again (in a fresh or forked process)."""
        self._suffix = secrets.token_hex(8)
        self._counter = itertools.count(1)

    def next(self) -> str:
        """A new token: ``<counter, hex><16 random hex digits>``."""
        return f"{next(self._counter):x}{self._suffix}"


_SOURCE = _TokenSource()
os.register_at_fork(after_in_child=_SOURCE.reset)


def new_token() -> str:
    """A token no other acquisition of any process is given (see the module's docstring)."""
    return _SOURCE.next()
