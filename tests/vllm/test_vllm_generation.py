"""Generation through ludic's vLLM server: token-in parity with transformers, seeds,
finish reasons, policy version, max_think, pause/resume and the API key."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import httpx  # noqa: E402
from tests.vllm.helpers import API_KEY, PROMPT, until_generating  # noqa: E402

from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec  # noqa: E402
from ludic.inference.vllm.client import VLLMChatClient, VLLMServerError  # noqa: E402


def test_greedy_tokens_and_logprobs_match_transformers(served):
    response = served.assert_parity()
    trace = response.trace
    assert trace.prompt_token_ids == PROMPT
    assert len(trace.completion_token_ids) == 8
    assert response.finish_reason == trace.finish_reason == "length"


def test_parity_holds_for_a_longer_chat_prompt(served):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    served.assert_parity(tuple(prompt))


def test_seeded_sampling_is_reproducible(served):
    sampling = {"temperature": 1.3, "max_tokens": 12, "seed": 1234}
    a = served.complete(sampling=sampling).trace
    b = served.complete(sampling=sampling).trace
    c = served.complete(sampling={**sampling, "seed": 4321}).trace
    assert a.completion_token_ids == b.completion_token_ids
    assert a.completion_token_ids != c.completion_token_ids
    # sampled tokens' logprobs are those of the policy that sampled them, softmax(logits /
    # 1.3) (the server's processed_logprobs), and the trace says so for the trainer
    assert a.logprob_temperature == 1.3
    _, ref = served.reference(PROMPT, a.completion_token_ids, temperature=1.3)
    assert max(abs(x - y) for x, y in zip(a.completion_logprobs, ref)) <= 1e-4
    _, raw = served.reference(PROMPT, a.completion_token_ids)
    assert max(abs(x - y) for x, y in zip(a.completion_logprobs, raw)) > 1e-2


def test_concurrent_requests_each_get_their_own_trace(served):
    async def run():
        requests = [
            CompletionRequest(
                PROMPT[: 3 + i], InferenceSpec(sampling=SamplingSpec(temperature=0.0, max_tokens=4))
            )
            for i in range(4)
        ]
        return await asyncio.gather(*(served.client.complete(r) for r in requests))

    for i, response in enumerate(asyncio.run(run())):
        assert response.trace.prompt_token_ids == PROMPT[: 3 + i]
        greedy, _ = served.reference(PROMPT[: 3 + i], response.trace.completion_token_ids)
        assert list(response.trace.completion_token_ids) == greedy


def test_concurrent_first_requests_ask_the_model_name_once(served):
    client = VLLMChatClient(served.server.url, api_key=API_KEY, timeout_s=60.0)
    asked = []
    get = client.http.get

    async def counting_get(path: str):
        asked.append(path)
        return await get(path)

    client.http.get = counting_get  # the real call, counted
    spec = InferenceSpec(sampling=SamplingSpec(temperature=0.0, max_tokens=2))

    async def run():
        return await asyncio.gather(
            *(client.complete(CompletionRequest(PROMPT, spec)) for _ in range(8))
        )

    try:
        responses = asyncio.run(run())
        assert len(responses) == 8 and asked == ["/v1/models"]
        assert client.model is not None
    finally:
        client.close()


def test_eval_requests_return_text_without_a_trace(served):
    from ludic.inference.request import ReturnSpec

    response = served.complete(returns=ReturnSpec.for_eval())
    assert response.trace is None
    assert isinstance(response.text, str)


def test_policy_version_comes_from_the_server(served):
    response = served.complete()
    assert response.trace.policy_version == served.client.get_policy_version()
    health = httpx.get(f"{served.server.url}/health").json()
    boot_id = health.pop("boot_id")  # fresh at every start: a restart shows in it
    assert health == {"status": "ok", "type": "policy", "version": response.policy_version}
    assert len(boot_id) == 32


def test_max_think_forces_think_end_after_n_thinking_tokens(served):
    tok = served.tokenizer
    think, think_end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = (*PROMPT, think)  # thinking is open at the start of the completion
    free = served.complete(prompt, sampling={"max_tokens": 10}).trace.completion_token_ids
    natural = free.index(think_end) if think_end in free else len(free)
    for budget in (0, 3):
        forced = served.complete(prompt, sampling={"max_tokens": 10}, max_think=budget).trace
        ids = forced.completion_token_ids
        first_end = ids.index(think_end)
        assert first_end == min(budget, natural)
        assert ids[:first_end] == free[:first_end]  # nothing changes before the cap


def test_max_think_leaves_prompts_without_open_thinking_alone(served):
    free = served.complete(sampling={"max_tokens": 6}).trace.completion_token_ids
    capped = served.complete(sampling={"max_tokens": 6}, max_think=0).trace.completion_token_ids
    assert capped == free


def test_invalid_max_think_is_a_400(served):
    with pytest.raises(VLLMServerError, match="max_think") as info:
        served.complete(max_think=-1)
    assert info.value.status_code == 400


def test_pause_aborts_in_flight_requests_and_resume_restores_service(served):
    control = served.client.control
    max_tokens = 1024 - len(PROMPT)  # the tiny model's whole context: as long as can be
    n_long = 8  # several at once, so each engine step is slower and the pause lands mid-way

    async def run():
        long = CompletionRequest(
            PROMPT,
            InferenceSpec(
                sampling=SamplingSpec(temperature=1.0, max_tokens=max_tokens),
                extra={"ignore_eos": True},
            ),
        )
        in_flight = [asyncio.create_task(served.client.complete(long)) for _ in range(n_long)]
        await until_generating(served.server.url)
        await asyncio.to_thread(control.pause)
        try:
            aborted = await asyncio.wait_for(asyncio.gather(*in_flight), timeout=30)
            assert (await asyncio.to_thread(control.get, "/is_paused"))["is_paused"]
            waiting = asyncio.create_task(served.client.complete(CompletionRequest(PROMPT)))
            await asyncio.sleep(1.0)
            assert not waiting.done(), "a request was served while paused"
        finally:
            await asyncio.to_thread(control.resume)
        return aborted, await asyncio.wait_for(waiting, timeout=30)

    # A request the scheduler ran ahead of the others may finish before the pause lands (a
    # loaded 2-core machine has served two of eight to the end); every other one is cut. A
    # stalled machine once delivered the pause after all eight had finished: the scenario
    # then says nothing about the pause, and runs again (at most twice more).
    for _attempt in range(3):
        aborted, after = asyncio.run(run())
        reasons = [(r.finish_reason, len(r.trace.completion_token_ids)) for r in aborted]
        if any(reason == "abort" for reason, _ in reasons):
            break
    assert sum(reason == "abort" for reason, _ in reasons) >= n_long // 2, reasons
    assert all(
        (reason == "abort" and n < max_tokens) or (reason == "length" and n == max_tokens)
        for reason, n in reasons
    ), reasons
    assert after.finish_reason in ("stop", "length")
    served.assert_parity()


@pytest.mark.parametrize(
    "path",
    [
        "/init_communicator",
        "/update_param_batch",
        "/close_communicator",
        "/get_num_background_tasks",
        "/reset_prefix_cache",
        "/pause",
        "/resume",
    ],
)
def test_control_routes_need_the_api_key(served, path):
    url = served.server.url + path
    assert httpx.post(url, json={}).status_code == 401
    assert httpx.post(url, json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_api_key_guards_completions_but_not_health(served):
    assert httpx.get(f"{served.server.url}/health").status_code == 200
    assert httpx.get(f"{served.server.url}/runtime_version").status_code == 401
    keyed = httpx.post(
        f"{served.server.url}/get_num_background_tasks",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert keyed.status_code == 200 and keyed.json()["num_background_tasks"] == 0
    keyless = VLLMChatClient(served.server.url, model=str(served.model_dir))
    with pytest.raises(VLLMServerError, match="401") as info:
        asyncio.run(keyless.complete(CompletionRequest(PROMPT)))
    assert info.value.status_code == 401
    keyless.close()


def test_a_completion_is_fast_once_the_server_is_warm(served):
    served.complete()
    started = time.monotonic()
    served.complete()
    assert time.monotonic() - started < 5.0


def test_pooled_connections_expire_before_the_server_closes_them():
    """A training step can outlast the server's keep-alive; a connection idle that long
    must not be reused, or a request can race the server's close (seen as a ReadError
    mid-run). The race itself is not reproducible on demand, so pin the invariant."""
    import vllm.envs

    from ludic.inference.vllm.client import KEEPALIVE_EXPIRY_S

    assert KEEPALIVE_EXPIRY_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
