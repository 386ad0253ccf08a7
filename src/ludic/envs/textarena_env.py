"""``TextArenaEnv``: TextArena's text games as a multi-agent ``LudicEnv``, for self-play from
one policy (docs/envs/textarena.md).

``game`` is a TextArena env id (a ``-train`` variant, with ``agent.context:
latest_observation``); players ``player_0`` .. ``player_{n-1}`` act one at a time. At the
end each player gets TextArena's reward and the game's info (one that never moved: 0);
TextArena handles illegal moves itself. The games draw from Python's and numpy's global
random generators: each env swaps its own states of both in around every call into the
game (under a lock), so an episode's draws are a function of its seed. Needs ``envs``.
"""

from __future__ import annotations

import contextlib
import difflib
import random
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ludic.envs.env import LudicEnv
from ludic.types import AgentId, Info, Observation, StepOutcome

WAITING = "Waiting for the other players."
"""The observation of a player whose turn it is not."""

_RANDOM = threading.Lock()  # the global random state is swapped under this lock


class TextArenaEnv(LudicEnv):
    """One TextArena game per episode; see the module docstring."""

    def __init__(
        self,
        *,
        game: str,
        num_players: int = 2,
        game_kwargs: Mapping[str, Any] | None = None,
        rng_seed: int | None = None,
    ) -> None:
        ta = _textarena()
        known = ta.envs.registration.ENV_REGISTRY
        if game not in known:
            close = difflib.get_close_matches(game, list(known), n=3)
            raise ValueError(f"game={game!r} is not a TextArena env id; close ones: {close}")
        if num_players < 1:
            raise ValueError(f"num_players={num_players}; expected >= 1")
        self.game = game
        self.num_players = num_players
        self.game_kwargs = dict(game_kwargs or {})
        self._ids = [f"player_{i}" for i in range(num_players)]
        self._rng = random.Random(rng_seed)
        self._state: tuple[Any, Any] = _seeded(0)
        self._env: Any = None
        self._current: int | None = None
        self._moved: set[int] = set()

    @property
    def agent_ids(self) -> list[AgentId]:
        return list(self._ids)

    @property
    def active_agents(self) -> list[AgentId]:
        return [] if self._current is None else [self._ids[self._current]]

    def reset(self, seed: int | None = None) -> dict[AgentId, tuple[Observation, Info]]:
        seed = self._rng.randrange(2**31) if seed is None else seed
        self._state = _seeded(seed)
        with self._own_random():
            self._env = _textarena().make(self.game, **self.game_kwargs)
            try:
                self._env.reset(num_players=self.num_players, seed=seed)
            except (AssertionError, ValueError) as e:
                raise ValueError(
                    f"TextArena game {self.game!r} with num_players={self.num_players}: {e}"
                ) from None
            player, obs = self._env.get_observation()
        self._current, self._moved = player, set()
        info = {"game": self.game}
        return {
            aid: (obs if i == player else WAITING, {**info, "player_id": i})
            for i, aid in enumerate(self._ids)
        }

    def step(self, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]:
        if self._env is None or self._current is None:
            raise RuntimeError("TextArenaEnv: the game is over or not started; call reset()")
        actor = self._ids[self._current]
        if set(actions) != {actor}:
            raise ValueError(f"TextArenaEnv.step got actions for {sorted(actions)}; {actor} moves")
        self._moved.add(self._current)
        with self._own_random():
            done, step_info = self._env.step(actions[actor])
            if done:
                rewards, game_info = self._env.close()
            else:
                player, obs = self._env.get_observation()
        if done:
            self._current = None
            return {aid: self._final(i, rewards, game_info) for i, aid in enumerate(self._ids)}
        self._current = player
        info = {k: v for k, v in dict(step_info or {}).items() if _plain(v)}
        outcomes = {actor: StepOutcome(obs=WAITING, reward=0.0)}
        outcomes[self._ids[player]] = StepOutcome(obs=obs, reward=0.0, info=info)
        return outcomes

    def _final(self, i: int, rewards: Mapping[int, float], game_info: Mapping) -> StepOutcome:
        info = {k: v for k, v in dict(game_info.get(i, {})).items() if _plain(v)}
        reward = float(rewards.get(i, 0.0)) if i in self._moved else 0.0
        info["moved"] = i in self._moved
        return StepOutcome(obs="The game is over.", reward=reward, terminated=True, info=info)

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """This env's random states (Python's and numpy's global ones) in place of the
        process's, for one call into the game."""
        with _RANDOM:
            outside = random.getstate(), np.random.get_state()
            random.setstate(self._state[0])
            np.random.set_state(self._state[1])
            try:
                yield
            finally:
                self._state = random.getstate(), np.random.get_state()
                random.setstate(outside[0])
                np.random.set_state(outside[1])


def _seeded(seed: int) -> tuple[Any, Any]:
    """Python's and numpy's global random states, seeded with ``seed``."""
    return random.Random(seed).getstate(), np.random.RandomState(seed % 2**32).get_state()


def _plain(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) or value is None


def _textarena() -> Any:
    try:
        import textarena
    except ImportError:
        raise ValueError(
            "env.kind textarena needs the textarena package: pip install 'ludic-rl[envs]'"
        ) from None
    return textarena
