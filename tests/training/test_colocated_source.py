"""``SleepingBatchSource``: the order of a colocated step. The server is awake while the
batch is generated and asleep once it is returned (the trainer trains on the freed GPU);
a step whose publish did not wake it gets it woken before the next generation. The real
sleep needs CUDA (tests/vllm/test_vllm_colocated.py); here the server records calls."""

from __future__ import annotations

import asyncio

import pytest

from ludic.training import SleepingBatchSource
from ludic.training.types import SAWBatch


class RecordingServer:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.asleep = False

    def sleep(self, level: int = 1) -> None:
        self.log.append(f"sleep({level})")
        self.asleep = True

    def wake_up(self) -> None:
        self.log.append("wake_up")
        self.asleep = False


class GeneratingSource:
    def __init__(self, server: RecordingServer) -> None:
        self.server = server
        self.closed = False

    async def next_batch(self) -> SAWBatch:
        assert not self.server.asleep, "generation must run on an awake server"
        self.server.log.append("generate")
        return SAWBatch(items=[], meta={})

    async def aclose(self) -> None:
        self.closed = True


def test_the_server_sleeps_through_training_and_is_woken_to_generate() -> None:
    log: list[str] = []
    server = RecordingServer(log)
    inner = GeneratingSource(server)
    source = SleepingBatchSource(inner, server, level=1)

    async def steps() -> None:
        await source.next_batch()
        log.append("train")
        server.asleep = False  # the step's publish woke it (sync_weights)
        log.append("publish")
        await source.next_batch()
        log.append("train")  # no publish this time: still asleep
        await source.next_batch()
        await source.aclose()

    asyncio.run(steps())
    assert log == [
        "generate", "sleep(1)", "train", "publish",
        "generate", "sleep(1)", "train",
        "wake_up", "generate", "sleep(1)",
        "wake_up",  # closed while asleep (a failed step): woken for its next clients
    ]  # fmt: skip
    assert inner.closed


def test_level_two_never_serves_dropped_weights() -> None:
    log: list[str] = []
    server = RecordingServer(log)
    source = SleepingBatchSource(GeneratingSource(server), server, level=2)

    async def steps() -> None:
        await source.next_batch()
        await source.next_batch()  # no publish woke it: its weights are gone

    with pytest.raises(RuntimeError, match=r"level 2 \(its weights dropped\)"):
        asyncio.run(steps())
    assert log == ["generate", "sleep(2)"]


def test_a_bad_level_is_refused() -> None:
    with pytest.raises(ValueError, match=r"level=3\); expected 1 or 2"):
        SleepingBatchSource(GeneratingSource(RecordingServer([])), RecordingServer([]), level=3)
