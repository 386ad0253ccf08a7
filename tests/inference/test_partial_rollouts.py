"""The pure parts of partial rollouts (``ludic.inference.vllm.partial``) and of the
admission gate (``ludic.inference.vllm.admission``), without a server: what a continuation
sends, how pieces are stitched and labelled, and the gate's hold/drain logic. The real
server paths are in ``tests/vllm/test_vllm_partial.py``."""

from __future__ import annotations

import asyncio

import pytest

from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec, SamplingSpec
from ludic.inference.vllm.admission import AdmissionGate
from ludic.inference.vllm.client import VLLMChatClient
from ludic.inference.vllm.partial import (
    PartialRolloutError,
    Segment,
    check_partial_rollouts,
    continuation_seed,
    next_request,
    stitch,
)

PROMPT = (1, 2, 3)


def request(returns: ReturnSpec | None = None, **sampling) -> CompletionRequest:
    spec = InferenceSpec(
        sampling=SamplingSpec(**{"max_tokens": 10, **sampling}),
        returns=returns or ReturnSpec.for_rl(),
        extra={"min_tokens": 4, "ignore_eos": True},
    )
    return CompletionRequest(PROMPT, spec)


def segment(ids, version, *, aborted=False, end=None, text="") -> Segment:
    return Segment(
        id=f"cmpl-{version}",
        text=text,
        token_ids=tuple(ids),
        logprobs=tuple(-0.5 * (i + 1) for i in range(len(ids))),
        finish_reason="abort" if aborted else "length",
        aborted=aborted,
        version=version,
        version_end=version if end is None else end,
    )


def test_a_continuation_sends_prompt_plus_partial_and_the_rest_of_the_budget():
    original = request(seed=7)
    sent = next_request(original, "continue", (9, 8, 7))
    assert sent.prompt_token_ids == (*PROMPT, 9, 8, 7)
    assert sent.sampling.max_tokens == 7
    assert sent.inference.extra == {"min_tokens": 1, "ignore_eos": True}
    assert sent.sampling.seed == continuation_seed(7, 3) != 7
    assert sent.sampling.temperature == original.sampling.temperature
    assert original.sampling.max_tokens == 10  # the original is untouched
    # nothing generated yet, or a restart: the original request (token ids asked for)
    assert next_request(original, "continue", ()).prompt_token_ids == PROMPT
    again = next_request(original, "restart", ())
    assert again.inference.sampling == original.sampling
    assert next_request(original, "off", ()) is original


def test_continuations_always_ask_for_token_ids_but_the_answer_honours_returns():
    eval_request = request(ReturnSpec.for_eval())
    assert next_request(eval_request, "continue", ()).returns.return_token_ids
    response = stitch(eval_request, [segment([5, 6], 3, aborted=True, text="ab"), segment([7], 4)])
    assert response.trace is None and response.text == "ab"


def test_stitching_labels_each_piece_with_its_version():
    kept = [segment([5, 6, 7], 3, aborted=True), segment([8, 9], 4)]
    response = stitch(request(), kept)
    trace = response.trace
    assert trace.completion_token_ids == (5, 6, 7, 8, 9)
    assert trace.completion_versions == (3, 3, 3, 4, 4)
    assert trace.policy_version == 3 and response.policy_version == 3
    assert trace.completion_logprobs == (-0.5, -1.0, -1.5, -0.5, -1.0)
    assert trace.finish_reason == response.finish_reason == "length"
    assert response.meta["discarded_tokens"] == 0
    assert [s["version"] for s in response.meta["segments"]] == [3, 4]


def test_an_empty_aborted_piece_does_not_label_the_completion():
    response = stitch(request(), [segment([], 3, aborted=True), segment([8, 9], 4)])
    assert response.trace.completion_versions == (4, 4)
    assert response.trace.policy_version == 4 == response.meta["policy_version"]


def test_a_restart_keeps_only_the_last_attempt_and_counts_what_it_discarded():
    first, second = segment([5, 6, 7], 3, aborted=True), segment([1, 2, 3, 4], 4)
    response = stitch(request(), [second], [first, second])
    assert response.trace.completion_token_ids == (1, 2, 3, 4)
    assert response.trace.token_versions() == (4, 4, 4, 4)
    assert response.meta["discarded_tokens"] == 3
    assert [s["num_tokens"] for s in response.meta["segments"]] == [3, 4]


def test_a_single_piece_carries_one_version_and_its_end_version():
    response = stitch(request(), [segment([5, 6], 3, end=4)])
    assert response.trace.completion_versions is None
    assert response.trace.token_versions() == (3, 3)  # the oldest: staleness is judged by it
    assert response.trace.version_end == response.trace.newest_version() == 4  # may be 4
    assert response.meta == {"id": "cmpl-3", "policy_version": 3, "policy_version_end": 4}
    # a continued completion: the straddling piece's end is kept, an exact one adds none
    kept = [segment([5, 6], 3, aborted=True, end=4), segment([7], 5)]
    trace = stitch(request(), kept).trace
    assert trace.completion_versions == (3, 3, 5) and trace.version_end is None
    kept = [segment([5, 6], 3, aborted=True), segment([7], 4, end=6)]
    assert stitch(request(), kept).trace.version_end == 6


def test_bad_modes_and_bounds_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"VLLMChatClient.partial_rollouts='resume'"):
        VLLMChatClient("http://127.0.0.1:1", partial_rollouts="resume")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_continuations=-1"):
        VLLMChatClient("http://127.0.0.1:1", max_continuations=-1)
    with pytest.raises(ValueError, match="expected one of"):
        check_partial_rollouts("maybe")
    assert issubclass(PartialRolloutError, RuntimeError)


# ------------------------------------------------------------------------- admission gate
def test_a_closed_gate_holds_adds_and_reopening_admits_them_at_the_version_then():
    async def run():
        gate, version = AdmissionGate(), [3]
        await gate.close(timeout_s=1)
        held = asyncio.create_task(gate.admit(lambda: version[0]))
        while gate.held != 1:
            await asyncio.sleep(0)
        assert not held.done() and gate.status()["open"] is False
        version[0] = 4  # a publish lands while the add waits
        gate.reopen()
        admitted = await held
        gate.done()
        return admitted, gate.status()

    admitted, status = asyncio.run(run())
    assert admitted == 4
    assert status == {"open": True, "held": 0, "adding": 0, "admitted": 0}


def test_closing_waits_for_adds_in_progress_and_gives_up_after_its_timeout():
    async def run():
        gate = AdmissionGate()
        await gate.admit(lambda: 0)  # an add past the gate, not yet in the engine
        closing = asyncio.create_task(gate.close(timeout_s=5))
        await asyncio.sleep(0)
        assert not closing.done() and not gate.is_open
        gate.done()  # the add reached the engine
        await closing
        gate.reopen()
        await gate.admit(lambda: 0)  # stuck
        with pytest.raises(TimeoutError, match="1 engine add"):
            await gate.close(timeout_s=0.05)
        return gate.is_open

    assert asyncio.run(run())  # a refused pause leaves the gate open
