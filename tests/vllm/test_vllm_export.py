"""A run's exported policy (RUN_DIR/policy, a Hugging Face folder) served by a real vLLM
server: greedy tokens and logprobs equal transformers' on the same folder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from tests.run.test_job import _config  # noqa: E402
from tests.vllm.helpers import API_KEY, MAX_ABS_LOGPROB_DIFF, PROMPT  # noqa: E402

from ludic import jobs  # noqa: E402
from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec  # noqa: E402
from ludic.inference.vllm.client import VLLMChatClient  # noqa: E402
from ludic.inference.vllm.process import start_vllm_server  # noqa: E402
from ludic.run.export import POLICY_DIR  # noqa: E402


def test_the_exported_policy_serves_on_vllm_as_it_runs_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = jobs.train(_config(tmp_path / "runs")) / POLICY_DIR
    server = start_vllm_server(folder, api_key=API_KEY, log_path=tmp_path / "server.log")
    client = VLLMChatClient(server.url, api_key=API_KEY, timeout_s=60.0)
    try:
        sampling = SamplingSpec(temperature=0.0, max_tokens=24)
        request = CompletionRequest(
            PROMPT, InferenceSpec(sampling=sampling, extra={"ignore_eos": True})
        )
        trace = asyncio.run(client.complete(request)).trace
    finally:
        client.close()
        server.stop()
    completion = list(trace.completion_token_ids)
    assert len(completion) == 24 and trace.completion_logprobs is not None

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[*PROMPT, *completion]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(PROMPT) - 1 : -1]
    chosen = logp.gather(1, torch.tensor(completion)[:, None])[:, 0]
    served = torch.tensor(trace.completion_logprobs, dtype=torch.float32)
    assert float((served - chosen).abs().max()) <= MAX_ABS_LOGPROB_DIFF
    assert bool((chosen >= logp.max(dim=-1).values - MAX_ABS_LOGPROB_DIFF).all())  # greedy
