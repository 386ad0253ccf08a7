"""Shared helpers of the vLLM server tests (see ``conftest.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_KEY = "ludic-test-key"
FAULT_ENV = "LUDIC_TEST_LOAD_FAULT"  # tests.vllm.fault_worker reads it
FAULT_WORKER = "tests.vllm.fault_worker.FaultInjectingWorker"


def python_path() -> str:
    """``$PYTHONPATH`` with the repository first: a server's workers import ``tests.*``."""
    repo = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)


AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = (72, 101, 108, 108, 111, 256, 257)  # "Hello" + two control tokens
MAX_ABS_LOGPROB_DIFF = 1e-4


@dataclass
class ServedPolicy:
    """The session server, a client with a weight-sync group, and the mirror model.

    The server runs the tests' worker extension (``tests.vllm.fault_worker``): ludic's own
    with a switch for load faults, off unless a test writes ``fault_file``."""

    server: Any  # VLLMServerProcess
    client: Any  # VLLMChatClient
    mirror: Any  # transformers Qwen2ForCausalLM holding the served weights
    tokenizer: Any
    model_dir: Path
    logprob_tol: float = MAX_ABS_LOGPROB_DIFF
    """Largest server vs mirror logprob difference :meth:`assert_parity` accepts."""
    root: Path | None = None
    server_args: tuple[str, ...] = ()
    """More server flags (e.g. ``--lora-rank 8``)."""

    @property
    def fault_file(self) -> Path:
        assert self.root is not None
        return self.root / "load_fault"

    def start(self, port: int | None = None) -> None:
        """Start the server (on ``port``, default a free one) and a client with a group."""
        self.start_server(port)
        self.connect()

    def start_server(self, port: int | None = None) -> None:
        from ludic.inference.vllm.process import start_vllm_server

        assert self.root is not None
        started = time.monotonic()
        self.server = start_vllm_server(
            self.model_dir,
            port=port,
            api_key=API_KEY,
            log_path=self.root / f"server-{int(started)}.log",
            extra_args=["--worker-extension-cls", FAULT_WORKER, *self.server_args],
            env={FAULT_ENV: str(self.fault_file), "PYTHONPATH": python_path()},
        )
        print(f"vLLM server up in {time.monotonic() - started:.1f}s ({self.server.log_path})")

    def connect(self) -> None:
        """A new client, with a new weight-sync group, to the server."""
        from ludic.distributed.weight_transfer import free_port
        from ludic.inference.vllm.client import VLLMChatClient

        self.client = VLLMChatClient(self.server.url, api_key=API_KEY, timeout_s=60.0)
        # a fresh port each time: a closed group's store may hold the last one a while
        self.client.init_weight_sync(master_port=free_port())

    def run_overrides(self) -> list[str]:
        """Config overrides for a ``ludic train`` run that uses this server instead of
        starting its own; after the run, :meth:`take_back`."""
        return [
            "inference.backend=vllm",
            "inference.vllm.start_server=false",
            f"inference.vllm.port={self.server.url.rsplit(':', 1)[1]}",
            f"inference.vllm.api_key={API_KEY}",
        ]

    def take_back(self, version: int = 49) -> None:
        """After a run used the server (it took the weight-sync group, synced its own
        weights, may have left it paused): resumed, a new group, the mirror's weights
        back as ``version``."""
        self.client.control.resume()
        self.client.close()
        self.connect()
        self.client.sync_weights(self.mirror.state_dict(), version=version)

    def stop(self) -> None:
        """Close the client and stop the server: no process of it is left."""
        import psutil

        self.client.close()
        server = self.server
        pids = [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]
        server.stop()
        assert_all_gone(pids)

    def complete(self, prompt=PROMPT, **spec_kwargs: Any):
        from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec

        sampling = {"temperature": 0.0, "max_tokens": 8}
        sampling.update(spec_kwargs.pop("sampling", {}))
        spec = InferenceSpec(sampling=SamplingSpec(**sampling), **spec_kwargs)
        return asyncio.run(self.client.complete(CompletionRequest(prompt, spec)))

    def reference(
        self, prompt, completion, temperature: float = 1.0
    ) -> tuple[list[int], list[float]]:
        """Greedy next tokens and the completion's logprobs under ``mirror`` at
        ``temperature`` (``softmax(logits / temperature)``)."""
        import torch

        ids = torch.tensor([list(prompt) + list(completion)])
        with torch.no_grad():
            logits = self.mirror(ids).logits[0].float()  # [T, V]
        logp = torch.log_softmax(logits / temperature, dim=-1)
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
        assert diff <= self.logprob_tol, f"max |logprob diff| = {diff}"
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


async def until_generating(url: str, timeout_s: float = 30.0) -> None:
    """Return as soon as the server has produced a generated token (a busy CPU may delay
    the start, a fast one must not be given time to finish)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as http:
        before = _generation_tokens((await http.get("/metrics")).text)
        while time.monotonic() < deadline:
            if _generation_tokens((await http.get("/metrics")).text) > before:
                return
            await asyncio.sleep(0.01)
    raise TimeoutError("the long requests never started generating")


def _generation_tokens(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


class AfterAnnounce:
    """A publisher's control plane that runs ``action()`` right after the ``n``-th chunk
    of a sync is announced (the workers wait for its bytes): a fault mid-transfer."""

    def __init__(self, inner: Any, n: int, action: Any) -> None:
        self.inner, self.n, self.action, self.count = inner, n, action, 0

    def announce(self, request: Any) -> None:
        self.inner.announce(request)
        self.count += 1
        if self.count == self.n:
            self.action()

    def wait_until_applied(self, timeout_s: float) -> None:
        self.inner.wait_until_applied(timeout_s)


def perturb(module: Any, seed: int, scale: float = 0.05) -> None:
    """Add seeded Gaussian noise to every parameter of ``module`` (a new policy)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


async def after_steps(client: Any, steps: int) -> None:
    """Return once the engine has run ``steps`` more decode steps: a greedy request of
    ``steps`` tokens (``ignore_eos``) has finished. A request already running when this
    is called has by then generated at least ``steps - 1`` tokens (continuous batching
    decodes both in the same steps); a cheap, exact clock, where ``/metrics`` can lag by
    more than a whole short generation."""
    from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec

    sampling = SamplingSpec(temperature=0.0, max_tokens=steps)
    spec = InferenceSpec(sampling=sampling, extra={"ignore_eos": True})
    response = await client.complete(CompletionRequest(PROMPT[:3], spec))
    assert len(response.trace.completion_token_ids) == steps, response.finish_reason


@contextlib.contextmanager
def policy_server(
    root: Path,
    logprob_tol: float = MAX_ABS_LOGPROB_DIFF,
    *,
    extra_args: Sequence[str] = (),
    cpu_cores: str | None = None,
    model_dir: Path | None = None,
    **model_config: int,
) -> Iterator[ServedPolicy]:
    """A ludic policy server on a tiny Qwen2 (``model_config``: ``save_tiny_model``'s
    sizes), or on ``model_dir``; ``extra_args``, ``cpu_cores``: ``start_vllm_server``'s;
    with a client in a weight-sync group and the mirror. Everything is stopped (no
    process left) on exit."""
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.inference.vllm.process import start_vllm_server
    from ludic.models.tiny import build_tiny_tokenizer, save_tiny_model

    if model_dir is None:
        model_dir = save_tiny_model(root / "model", **model_config)
    server = start_vllm_server(
        model_dir,
        api_key=API_KEY,
        log_path=root / "server.log",
        extra_args=extra_args,
        cpu_cores=cpu_cores,
    )
    client = VLLMChatClient(server.url, api_key=API_KEY, timeout_s=60.0)
    mirror = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        client.init_weight_sync(master_port=server.group_port)
        yield ServedPolicy(
            server, client, mirror, build_tiny_tokenizer(), model_dir, logprob_tol, root=root
        )
    finally:
        client.close()
        pids = [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]
        server.stop()
        assert_all_gone(pids)


def peft_policy(base: Any, seed: int, rank: int = 8) -> Any:
    """A LoRA policy on a copy of ``base`` whose adapter changes its outputs (B != 0)."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(copy.deepcopy(base), config)
    set_adapter(model, seed)
    return model.eval()


def set_adapter(model: Any, seed: int) -> None:
    """Draw the adapter's tensors at random (scale 0.3), seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
