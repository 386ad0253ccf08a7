"""``on_compute_thread``: every call runs on one named thread, in order; errors and
context variables come back; a call from the compute thread itself is refused."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time

import pytest
import torch

from ludic._async import compute_calls_in_flight, on_compute_thread, raise_if_abandoned

REQUEST = contextvars.ContextVar("REQUEST", default="unset")


def test_calls_share_one_thread_and_keep_their_order() -> None:
    seen: list[tuple[str, int]] = []

    def work(i: int) -> int:
        seen.append((threading.current_thread().name, i))
        return i * i

    async def run() -> list[int]:
        return list(await asyncio.gather(*(on_compute_thread(work, i) for i in range(8))))

    assert asyncio.run(run()) == [i * i for i in range(8)]
    assert [i for _, i in seen] == list(range(8))
    names = {name for name, _ in seen}
    assert len(names) == 1 and names.pop().startswith("ludic-compute")
    assert threading.current_thread().name != "ludic-compute"


def test_errors_and_context_variables_come_through() -> None:
    def fail() -> None:
        raise ValueError("from the compute thread")

    async def run() -> str:
        REQUEST.set("step 3")
        with pytest.raises(ValueError, match="from the compute thread"):
            await on_compute_thread(fail)
        return await on_compute_thread(REQUEST.get)

    assert asyncio.run(run()) == "step 3"


def test_a_call_from_the_compute_thread_is_refused_not_deadlocked() -> None:
    def nested() -> None:
        asyncio.run(on_compute_thread(lambda: None))

    with pytest.raises(RuntimeError, match="would deadlock"):
        asyncio.run(on_compute_thread(nested))


def test_a_cancelled_call_stops_at_its_next_check_and_a_queued_one_never_runs() -> None:
    started = threading.Event()
    steps: list[int] = []
    queued_ran: list[bool] = []

    def long_loop() -> None:
        started.set()
        for i in range(10_000):
            raise_if_abandoned()
            steps.append(i)
            time.sleep(0.001)

    async def run() -> None:
        running = asyncio.ensure_future(on_compute_thread(long_loop))
        queued = asyncio.ensure_future(on_compute_thread(queued_ran.append, True))
        await asyncio.to_thread(started.wait, 5)
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while compute_calls_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compute_calls_in_flight() == 0
    assert 0 < len(steps) < 10_000  # stopped early, not run to the end
    assert queued_ran == []


def test_a_cancelled_generation_stops_drawing_from_the_global_rng(
    tiny_model, tiny_tokenizer
) -> None:
    """An abandoned in-process generation (a timed-out caller) must not keep sampling on
    the compute thread, racing whatever runs next for torch's global generator."""
    from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec
    from ludic.inference.transformers_client import TransformersChatClient

    never = tiny_model.config.vocab_size + 7  # no EOS: it would sample all 900 tokens
    client = TransformersChatClient(tiny_model, tiny_tokenizer, eos_token_ids=[never])
    sampling = SamplingSpec(temperature=1.0, max_tokens=900)
    request = CompletionRequest((5, 6, 7), InferenceSpec(sampling=sampling))
    forwards: list[int] = []  # the output head runs once per decoded token, either decoder
    hook = tiny_model.lm_head.register_forward_hook(lambda *_: forwards.append(1))

    async def run() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.complete(request), timeout=0.2)

    asyncio.run(run())  # ends by cancelling the client's batching task
    started = time.monotonic()
    while compute_calls_in_flight() and time.monotonic() < started + 10:
        time.sleep(0.01)
    hook.remove()
    assert compute_calls_in_flight() == 0
    assert 0 < len(forwards) < 900  # stopped after the cancel, not run to the end
    state = torch.get_rng_state()
    time.sleep(0.2)
    assert torch.equal(torch.get_rng_state(), state)
