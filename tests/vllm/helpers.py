"""Shared helpers of the vLLM server tests (see ``conftest.py``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_KEY = "ludic-test-key"
PROMPT = (72, 101, 108, 108, 111, 256, 257)  # "Hello" + two control tokens
MAX_ABS_LOGPROB_DIFF = 1e-4


@dataclass
class ServedPolicy:
    """The session server, a client with a weight-sync group, and the mirror model."""

    server: Any  # VLLMServerProcess
    client: Any  # VLLMChatClient
    mirror: Any  # transformers Qwen2ForCausalLM holding the served weights
    tokenizer: Any
    model_dir: Path

    def complete(self, prompt=PROMPT, **spec_kwargs: Any):
        from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec

        sampling = {"temperature": 0.0, "max_tokens": 8}
        sampling.update(spec_kwargs.pop("sampling", {}))
        spec = InferenceSpec(sampling=SamplingSpec(**sampling), **spec_kwargs)
        return asyncio.run(self.client.complete(CompletionRequest(prompt, spec)))

    def reference(self, prompt, completion) -> tuple[list[int], list[float]]:
        """Greedy next tokens and the completion's logprobs under ``mirror``."""
        import torch

        ids = torch.tensor([list(prompt) + list(completion)])
        with torch.no_grad():
            logits = self.mirror(ids).logits[0].float()  # [T, V]
        logp = torch.log_softmax(logits, dim=-1)
        n = len(prompt)
        greedy = logits[n - 1 : -1].argmax(-1).tolist()
        chosen = [float(logp[n - 1 + i, t]) for i, t in enumerate(completion)]
        return greedy, chosen

    def assert_parity(self, prompt=PROMPT):
        """The server's greedy completion and logprobs equal the mirror's; returns it."""
        response = self.complete(prompt)
        trace = response.trace
        greedy, ref = self.reference(prompt, trace.completion_token_ids)
        assert list(trace.completion_token_ids) == greedy
        diff = max(abs(a - b) for a, b in zip(trace.completion_logprobs, ref))
        assert diff <= MAX_ABS_LOGPROB_DIFF, f"max |logprob diff| = {diff}"
        return response


def assert_all_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    """No process of ``pids`` is left (zombies count as gone)."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"orphan processes left after stop(): {left}"
