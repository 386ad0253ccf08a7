"""The rollout engine: a stateless factory floor that turns requests into rollouts.

For each request and each of its ``num_episodes`` episodes it builds a fresh env
(``env_registry[kind](**kwargs)``) and protocol and runs ``protocol.run``, at most
``max_concurrency`` at a time. A request's episodes share ``request.env_seed``; episode
``e`` samples with seed ``sampling.seed + e`` (``None`` if unset). Each rollout's ``meta``
gets, without overwriting the protocol's: the request's ``meta``, ``env_kind``,
``protocol_kind``, ``env_seed``, ``sampling_seed``, ``episode_index``, ``request_index``.
Turning rollouts into training data is ``ludic.training.RolloutBatchSource``'s job.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from ludic._async import gather_or_cancel
from ludic.envs.env import LudicEnv
from ludic.interaction.base import InteractionProtocol
from ludic.interaction.env_calls import close_env, env_calls_in_threads
from ludic.rollouts.requests import RolloutRequest
from ludic.types import ContractError, Rollout, rollout_to_dict

EnvCalls = Literal["inline", "thread"]
ENV_CALLS: tuple[str, ...] = ("inline", "thread")

EnvFactory = Callable[..., LudicEnv]
ProtocolFactory = Callable[..., InteractionProtocol]


class UnknownKindError(KeyError):
    """A request names an env or protocol kind that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RolloutEngine:
    """Runs ``RolloutRequest``s and returns rollouts (or a ready ``SAWBatch``).

    Args:
        env_registry: env kind -> factory called with ``EnvSpec.kwargs``.
        protocol_registry: protocol kind -> factory called with ``ProtocolSpec.kwargs``.
        max_concurrency: episodes in flight at once.
        jsonl_path: if set, every rollout is appended there as one JSON line
            (``rollout_to_dict``), the format ``OfflineBatchSource`` reads.
        timeout_s: if set, an episode running longer raises ``TimeoutError`` (naming the
            env kind, seed and limit) and is dropped.
        env_calls: ``"inline"`` runs env ``reset``/``step`` on the event loop
            (deterministic batching; a blocking env delays the timeout until its call
            returns). ``"thread"`` runs them in a daemon thread
            (``ludic.interaction.env_calls``), so a blocking env cannot outlast
            ``timeout_s``; the abandoned call finishes in the background and ``close()``
            follows it. Use it for envs that block (sandboxes, simulators, remote calls).
        on_episode: callables given each episode's rollouts the moment it ends, on the
            event loop (they must not block; e.g. ``RewardLoop.on_episode`` schedules
            scoring that overlaps the episodes still running).
    """

    def __init__(
        self,
        env_registry: Mapping[str, EnvFactory],
        protocol_registry: Mapping[str, ProtocolFactory],
        *,
        max_concurrency: int = 32,
        jsonl_path: str | Path | None = None,
        timeout_s: float | None = None,
        env_calls: EnvCalls = "inline",
        on_episode: Sequence[Callable[[list[Rollout]], None]] = (),
    ) -> None:
        if env_calls not in ENV_CALLS:
            raise ValueError(
                f"RolloutEngine: env_calls={env_calls!r}; expected one of {list(ENV_CALLS)}"
            )
        if max_concurrency < 1:
            raise ValueError(f"RolloutEngine: max_concurrency must be >= 1, got {max_concurrency}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"RolloutEngine: timeout_s must be > 0 or None, got {timeout_s}")
        self.env_registry = dict(env_registry)
        self.protocol_registry = dict(protocol_registry)
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.env_calls = env_calls
        self.on_episode = tuple(on_episode)
        """Called with each episode's rollouts as soon as the episode ends (e.g. a reward
        loop in standalone mode starts scoring them while other episodes still run)."""
        self.jsonl_path = None if jsonl_path is None else Path(jsonl_path)
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)

    # ---- building ------------------------------------------------------------------

    def _factory(self, what: str, registry: Mapping[str, Callable[..., Any]], kind: str) -> Any:
        try:
            return registry[kind]
        except KeyError:
            raise UnknownKindError(
                f"unknown {what} kind {kind!r}; registered: {sorted(registry)}. Register it in "
                f"RolloutEngine({what}_registry={{{kind!r}: factory, ...}})"
            ) from None

    def _check_kinds(self, requests: Sequence[RolloutRequest]) -> None:
        """Fail before any episode starts if a request names an unregistered kind."""
        for req in requests:
            self._factory("env", self.env_registry, req.env.kind)
            self._factory("protocol", self.protocol_registry, req.protocol.kind)

    # ---- running -------------------------------------------------------------------

    async def _run_episode(
        self, req: RolloutRequest, request_index: int, episode: int, sem: asyncio.Semaphore
    ) -> list[Rollout]:
        with env_calls_in_threads(self.env_calls == "thread"):  # this episode's task only
            return await self._episode(req, request_index, episode, sem)

    async def _episode(
        self, req: RolloutRequest, request_index: int, episode: int, sem: asyncio.Semaphore
    ) -> list[Rollout]:
        sampling_seed = req.inference.sampling.seed
        if sampling_seed is not None:
            sampling_seed += episode
        meta: dict[str, Any] = {
            **req.meta,
            "env_kind": req.env.kind,
            "protocol_kind": req.protocol.kind,
            "env_seed": req.env_seed,
            "sampling_seed": sampling_seed,
            "episode_index": episode,
            "request_index": request_index,
        }
        async with sem:
            protocol = self._factory("protocol", self.protocol_registry, req.protocol.kind)(
                **req.protocol.kwargs
            )
            env = self._factory("env", self.env_registry, req.env.kind)(**req.env.kwargs)
            deadline = asyncio.timeout(self.timeout_s)
            try:
                async with deadline:
                    rollouts = await protocol.run(
                        env=env,
                        max_steps=req.max_steps,
                        env_seed=req.env_seed,
                        inference=req.inference.with_seed(sampling_seed),
                        meta=dict(meta),
                    )
                    if _overdue(deadline):  # a blocking inline env call outlasted the limit
                        raise TimeoutError
            except ContractError as e:  # an env or parser broke its contract: say where
                raise ContractError(
                    f"{e} (episode {episode} of request {request_index}, env={req.env.kind!r}, "
                    f"env_seed={req.env_seed})"
                ) from e
            except TimeoutError:
                if not (deadline.expired() or _overdue(deadline)):
                    raise
                raise TimeoutError(
                    f"episode {episode} of request {request_index} (env={req.env.kind!r}, "
                    f"protocol={req.protocol.kind!r}, env_seed={req.env_seed}) did not finish "
                    f"within timeout_s={self.timeout_s}; raise RolloutEngine(timeout_s=...) or "
                    "lower max_steps / sampling.max_tokens"
                ) from None
            finally:
                close_env(env)  # waits for an abandoned (timed-out) env call, off the loop
        for r in rollouts:
            for key, value in meta.items():
                r.meta.setdefault(key, value)
        self._log(rollouts)
        for callback in self.on_episode:
            callback(list(rollouts))
        return list(rollouts)

    def _log(self, rollouts: Sequence[Rollout]) -> None:
        if self.jsonl_path is None or not rollouts:
            return
        with self.jsonl_path.open("a", encoding="utf-8") as f:
            for r in rollouts:
                f.write(json.dumps(rollout_to_dict(r), ensure_ascii=False, default=str) + "\n")

    async def generate_rollouts(self, requests: Sequence[RolloutRequest]) -> list[Rollout]:
        """Run every episode of every request; rollouts come back in request order, then
        episode order (then the protocol's order). If one episode fails, the others are
        cancelled and the error is raised."""
        self._check_kinds(requests)
        sem = asyncio.Semaphore(self.max_concurrency)
        results = await gather_or_cancel(
            *(
                self._run_episode(req, i, e, sem)
                for i, req in enumerate(requests)
                for e in range(req.num_episodes)
            )
        )
        return [r for episode in results for r in episode]


def _overdue(deadline: asyncio.Timeout) -> bool:
    """Whether ``deadline`` has passed, even if it could not fire (no await since then)."""
    when = deadline.when()
    return when is not None and asyncio.get_running_loop().time() >= when
