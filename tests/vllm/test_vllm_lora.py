"""Adapter-only LoRA syncs (``ludic.inference.vllm.adapter``) into a real vLLM CPU server
started the way ``ludic train`` starts one (``run.servers.vllm_server_client``) with
``--lora-rank 8``: the trainer's peft adapter alone is sent, loaded by vLLM's LoRA support
in place, verified (checksums as vLLM's adapter cache holds it, and the canary), and
serves every request; a later full-weight sync serves the base again. A worker whose
loader corrupts one adapter value fails the sync naming the tensor.

The same server carries issue 9's key check (``tests/faults/test_train_api_key.py``): with
no key configured, a server ludic starts gets a fresh random one only its client knows."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from unittest import mock

import httpx
import psutil
import pytest
import torch
from tests.vllm.helpers import (
    AUTH,
    FAULT_ENV,
    FAULT_WORKER,
    PROMPT,
    ServedPolicy,
    peft_policy,
    python_path,
    set_adapter,
)

pytest.importorskip("vllm", reason="vLLM is not installed")

from ludic.distributed.weight_transfer.verify import SyncVerificationError  # noqa: E402
from ludic.distributed.weights import (  # noqa: E402
    adapter_config,
    adapter_state_dict,
    policy_state_dict,
)
from ludic.inference.vllm.canary import ModelCanary  # noqa: E402

RANK = 8
LOGPROB_TOL = 1e-3
"""Server vs the peft model (float32): vLLM adds the LoRA product in its own kernel
order, the peft model in its own."""
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def lora_served(tmp_path_factory: pytest.TempPathFactory):
    """``vllm_server_client`` as ``ludic train`` calls it (no key in the config or the
    environment), with the tests' fault worker; ``served.key`` is the key it chose."""
    from transformers import AutoModelForCausalLM

    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.models.tiny import build_tiny_tokenizer, save_tiny_model
    from ludic.run.config import VLLMConfig
    from ludic.run.servers import vllm_server_client

    root = tmp_path_factory.mktemp("vllm_lora")
    model_dir = save_tiny_model(root / "model")
    served = ServedPolicy(
        None, None, None, build_tiny_tokenizer(), model_dir, logprob_tol=LOGPROB_TOL, root=root
    )
    seen: dict[str, str | None] = {}

    def connect(url: str, timeout_s: float, key: str | None) -> VLLMChatClient:
        seen["url"], seen["key"] = url, key
        return VLLMChatClient(url, timeout_s=timeout_s, api_key=key)

    server_env = {FAULT_ENV: str(served.fault_file), "PYTHONPATH": python_path()}
    with mock.patch.dict(os.environ, server_env):  # the server inherits it
        os.environ.pop("LUDIC_API_KEY", None)
        started = vllm_server_client(
            VLLMConfig(extra_args=["--worker-extension-cls", FAULT_WORKER]),
            kind="policy",
            field="inference.vllm",
            model=model_dir,
            cuda=False,
            log_dir=root,
            connect=connect,
            lora_rank=RANK,
        )
        client = started.__enter__()
    try:
        served.client, served.url, served.key = client, seen["url"], seen["key"]
        served.mirror = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        yield served
    finally:
        started.__exit__(None, None, None)
    assert served.key not in (root / "vllm_server.log").read_text(errors="replace")


def test_a_started_server_gets_a_random_key_that_only_the_client_knows(lora_served):
    key, url = lora_served.key, lora_served.url
    assert key and len(key) >= 32
    assert lora_served.client.get_policy_version() == 0  # the weight-sync group formed with it
    assert httpx.get(f"{url}/get_world_size").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    servers = [
        p for p in psutil.Process().children(recursive=True) if "serve" in " ".join(p.cmdline())
    ]
    assert servers and all(key not in " ".join(p.cmdline()) for p in servers)
    assert key not in Path(lora_served.root, "vllm_server.log").read_text(errors="replace")


def test_an_adapter_sync_serves_the_policy_verified_and_a_full_sync_the_base(lora_served):
    served, base = lora_served, lora_served.mirror
    client = served.client
    policy = peft_policy(base, seed=1)
    adapter = adapter_state_dict(policy)
    full = policy_state_dict(policy)
    assert set(adapter) >= {Q_A} and all(".lora_" in n for n in adapter)
    sent = sum(t.numel() * t.element_size() for t in adapter.values())
    assert sent * 20 < sum(t.numel() * t.element_size() for t in full.values())

    client.set_lora_adapter(adapter_config(policy))
    client.set_canary(ModelCanary(policy), every=1)
    try:
        for version, seed in ((1, 1), (2, 2)):  # the second replaces the first in place
            set_adapter(policy, seed)
            client.sync_weights(adapter_state_dict(policy), version=version)
            assert client.weight_sync.canary_diffs[-1][0] == version  # the canary ran
            served.mirror = policy
            response = served.assert_parity()
            assert response.trace.policy_version == version
            served.mirror = base  # the adapter changes what is served
            greedy, ref = served.reference(PROMPT, response.trace.completion_token_ids)
            diff = max(abs(a - b) for a, b in zip(response.trace.completion_logprobs, ref))
            assert diff > 10 * LOGPROB_TOL
        report = client.weight_sync.control.weight_report()["workers"][0]
        assert report["adapter"] and set(report["loaded"]) == set(adapter)
        assert client.weight_sync.verified == 2

        client.set_canary(ModelCanary(base), every=1)
        client.sync_weights(policy_state_dict(base), version=3)  # full weights: no adapter
        served.mirror = base
        assert served.assert_parity().trace.policy_version == 3
    finally:
        served.mirror = base
        client.set_lora_adapter(None)
        client.set_canary(None)


def test_a_loader_that_corrupts_an_adapter_value_fails_the_sync_naming_it(lora_served):
    served = lora_served
    policy = peft_policy(served.mirror, seed=3)
    served.client.set_lora_adapter(adapter_config(policy))
    served.fault_file.write_text(f"corrupt {Q_A}")
    try:
        with pytest.raises(SyncVerificationError, match=f"{Q_A}.*does not hold the received"):
            served.client.sync_weights(adapter_state_dict(policy), version=4)
    finally:
        served.fault_file.write_text("")
    served.client.sync_weights(adapter_state_dict(policy), version=5)  # verified
    served.client.set_lora_adapter(None)
    served.client.sync_weights(policy_state_dict(served.mirror), version=6)
    served.assert_parity()


def test_a_server_without_lora_support_refuses_an_adapter_sync_naming_the_flag(served):
    reply = httpx.post(
        f"{served.server.url}/lora_adapter",
        json={"name": "x", "config": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}},
        headers=AUTH,  # the session server's key
        timeout=10,
    )
    assert reply.status_code == 409 and "--lora-rank" in reply.text


def test_an_adapter_sync_needs_the_config_and_the_adapter_alone(lora_served):
    from peft import LoraConfig, get_peft_model

    policy = peft_policy(lora_served.mirror, seed=4)
    adapter = adapter_state_dict(policy)
    sync = lora_served.client.weight_sync
    with pytest.raises(ValueError, match="set_lora_adapter"):
        sync.publish(adapter, version=7)
    sync.lora_adapter = adapter_config(policy)
    try:
        with pytest.raises(ValueError, match="mixes LoRA tensors"):
            sync.publish({**adapter, "model.norm.weight": torch.ones(64)}, version=7)
        too_big = {**adapter_config(policy), "r": 64}
        reply = httpx.post(
            f"{lora_served.url}/lora_adapter",
            json={"name": "x", "config": too_big},
            headers={"Authorization": f"Bearer {lora_served.key}"},
            timeout=10,
        )
        assert reply.status_code == 400 and "--max-lora-rank 8" in reply.text
    finally:
        sync.lora_adapter = None
    dora = get_peft_model(
        copy.deepcopy(lora_served.mirror),
        LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
    )
    with pytest.raises(ValueError, match="use_dora"):
        adapter_config(dora)
