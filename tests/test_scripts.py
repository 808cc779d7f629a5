"""The Lua scripts as sent: composed from their files, with errors that name a real line."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis

from celery_semaphore.core.calls import SCRIPT_KEYS, Call
from celery_semaphore.core.names import Namespace
from celery_semaphore.core.scripts import _SOURCES, Scripts

LUA = resources.files("celery_semaphore.core").joinpath("lua")


def test_every_line_sent_maps_back_to_the_same_line_of_a_file() -> None:
    for name, source in _SOURCES.items():
        for number, line in enumerate(source.text.split("\n"), 1):
            file, at = source.where(number).split(":")
            assert LUA.joinpath(file).read_text().split("\n")[int(at) - 1] == line, (name, number)


def test_no_script_takes_more_than_eight_argv() -> None:
    for file in LUA.iterdir():
        found = [int(n) for n in re.findall(r"ARGV\[(\d+)\]", file.read_text())]
        assert max(found, default=0) <= 8, file.name


def test_a_helpers_error_names_the_helper_file_and_line(client: redis.Redis) -> None:
    keys = Namespace("semaphore", False).keys_of("k")
    # A limit that is not a number fails in free.lua's comparison, composed into take.lua.
    call = Call("take", keys[SCRIPT_KEYS["take"]], ("many", 1000, "t", 1), lambda r: r)
    with pytest.raises(redis.ResponseError, match=r"\[at lua/free\.lua:(\d+)\]") as caught:
        Scripts(client).run(call)
    line = int(re.search(r"free\.lua:(\d+)", str(caught.value)).group(1))  # type: ignore[union-attr]
    assert "limit" in LUA.joinpath("free.lua").read_text().split("\n")[line - 1]
