"""Reward servers that sleep between batches (``reward_loop.{disrm,genrm,group_judge}.sleep``).

For ``reward_loop.mode: colocate`` on CUDA (docs/reward-loop.md): such servers start with
``--enable-sleep-mode``, sleep once the probe has scored through them, and the loop wakes
them for each batch (:class:`~ludic.rewards.loop.ScoringServers`). ``keep_weights``:
``POST /sleep?level=1``, woken by ``/wake_up``. ``reload_weights``: ``level=2``; waking
allocates the weights (``/wake_up?tags=weights``), reads them from the model folder
(``/load_weights_from_disk``, ``--weight-load-roots``), checks them against its checksums,
then restores the KV cache (``/wake_up?tags=kv_cache``). Tests need a GPU and vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["SLEEP_LEVELS", "RewardServerSleep", "SleepingServer", "sleep_server_args"]

SleepSetting = Literal["off", "keep_weights", "reload_weights"]

SLEEP_LEVELS: dict[str, int] = {"keep_weights": 1, "reload_weights": 2}
"""``sleep`` setting -> vLLM sleep level."""


def sleep_server_args(sleep: SleepSetting, model: str | Path) -> list[str]:
    """The extra command line of a reward server that sleeps (none for ``off``)."""
    if sleep == "off":
        return []
    args = ["--enable-sleep-mode"]
    if sleep == "reload_weights":  # its wake reads the model folder again
        args += ["--weight-load-roots", str(Path(model).resolve())]
    return args


@dataclass
class SleepingServer:
    """One started reward server that sleeps: its control plane, level and model folder
    (``expected``: the folder's checksums, for a level-2 wake's check)."""

    control: Any  # VLLMControlPlane
    level: int
    folder: Path
    expected: Any = None  # SentChecksums


class RewardServerSleep:
    """:class:`~ludic.rewards.loop.ScoringServers` over started reward servers."""

    def __init__(self, servers: Sequence[SleepingServer], *, timeout_s: float) -> None:
        self.servers = list(servers)
        self.timeout_s = timeout_s
        self.asleep = False

    @classmethod
    def start(
        cls, urls_levels: Sequence[tuple[str, int, Path]], *, api_key: str | None, timeout_s: float
    ) -> RewardServerSleep:
        """Over the servers at each URL (with its sleep level and model folder); a
        level-2 server's folder checksums are taken now."""
        from ludic.distributed.weight_transfer.manifest import expected_checksums
        from ludic.inference.vllm.http import VLLMControlPlane

        servers = []
        for url, level, folder in urls_levels:
            control = VLLMControlPlane(url, api_key=api_key, timeout_s=timeout_s)
            expected = expected_checksums(folder) if level == 2 else None
            servers.append(SleepingServer(control, level, Path(folder), expected))
        return cls(servers, timeout_s=timeout_s)

    def sleep_now(self) -> None:
        for server in self.servers:
            server.control.sleep(server.level)
        self.asleep = True

    def wake_now(self) -> None:
        from ludic.inference.vllm.weight_sync import load_verified

        for server in self.servers:
            control = server.control
            if server.level == 1:
                control.wake_up()
                continue
            control.wake_up(["weights"])
            load_verified(
                control,
                str(server.folder),
                version=None,
                expected=server.expected,
                timeout_s=self.timeout_s,
            )
            control.wake_up(["kv_cache"])
        self.asleep = False

    async def sleep(self) -> None:
        await asyncio.to_thread(self.sleep_now)

    async def wake(self) -> None:
        await asyncio.to_thread(self.wake_now)

    def close(self) -> None:
        for server in self.servers:
            server.control.close()
