"""A trainer and a vLLM server on one GPU: the server sleeps while the trainer trains.

:class:`SleepingBatchSource` wakes the server if a step left it asleep (one that published
nothing), generates, then puts it to sleep (vLLM sleep mode: level 1 moves the weights to CPU
memory, level 2 frees them; the KV cache is freed either way), so the trainer has the GPU. The
publish after the step wakes it (``VLLMChatClient.sync_weights``: weights by CUDA IPC, then KV)::

    source = SleepingBatchSource(RolloutBatchSource(...), client, level=1)
    trainer = Trainer(policy, algorithm, source, config, publisher=ClientPolicyPublisher(client))
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from ludic.training.types import BatchSource, SAWBatch

__all__ = ["SleepingBatchSource", "SleepingServer"]


class SleepingServer(Protocol):
    """The client side of a server with sleep mode (``VLLMChatClient``)."""

    asleep: bool

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self) -> None: ...


class SleepingBatchSource:
    """``source``'s batches, generated with the server awake; the server asleep after."""

    def __init__(self, source: BatchSource, server: SleepingServer, *, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"SleepingBatchSource(level={level}); expected 1 or 2")
        self.source = source
        self.server = server
        self.level = level

    async def next_batch(self) -> SAWBatch:
        if self.server.asleep:  # the last step published nothing: wake without a sync
            if self.level == 2:
                raise RuntimeError(
                    "the server slept at level 2 (its weights dropped) and no publish woke it; "
                    "publish after every step (trainer.publish_every: 1) or use level 1"
                )
            await asyncio.to_thread(self.server.wake_up)
        batch = await self.source.next_batch()
        await asyncio.to_thread(self.server.sleep, self.level)
        return batch

    async def aclose(self) -> None:
        """Close the inner source; a server left asleep (a failed step) is woken, so it
        does not hold its next clients at a closed gate."""
        aclose: Any = getattr(self.source, "aclose", None)
        if aclose is not None:
            await aclose()
        if self.server.asleep:
            await asyncio.to_thread(self.server.wake_up)
