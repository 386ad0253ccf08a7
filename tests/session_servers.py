"""The session's vLLM servers, started side by side.

A server's start-up is mostly one core's work (about 40 s on this project's machine). When
the collected tests use both the policy server (``served``) and the reward server
(``served_reward``), setting up ``served`` starts the reward server too, without waiting
for it; ``served_reward`` then takes that process and waits for its health. A process never
taken is stopped when the session ends."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

_USED = pytest.StashKey[set[str]]()
_EARLY = pytest.StashKey[dict[str, Any]]()


def note_fixtures(config: pytest.Config, items: Iterable[pytest.Item]) -> None:
    """Record which fixtures the collected tests use."""
    config.stash[_USED] = {name for item in items for name in getattr(item, "fixturenames", ())}


def start_early(config: pytest.Config, fixture: str, start: Callable[[], Any]) -> None:
    """``start()`` (a server started without waiting) for ``fixture`` if a collected test
    uses it."""
    early = config.stash.setdefault(_EARLY, {})
    if fixture in config.stash.get(_USED, set()) and fixture not in early:
        early[fixture] = start()


def take_early(config: pytest.Config, fixture: str) -> Any | None:
    """The server :func:`start_early` started for ``fixture``, now the caller's; else None."""
    return config.stash.get(_EARLY, {}).pop(fixture, None)


def stop_untaken(config: pytest.Config) -> None:
    for server in config.stash.get(_EARLY, {}).values():
        server.stop()
    config.stash[_EARLY] = {}
