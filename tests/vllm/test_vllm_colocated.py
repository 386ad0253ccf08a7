"""Issue 14, colocated GPU mode: a trainer on the server's GPU syncs through CUDA IPC
(``cuda_ipc``: a handle per tensor; ``packed_cuda_ipc``: one per chunk) and puts the server
to sleep while it trains (vLLM sleep mode), the weight sync waking it.

Here on CPU, against the real CPU server: the IPC strategies and sleep/wake are refused
with errors that say why, the API key guards the new routes, and the server keeps serving
and syncing afterwards. On a GPU (skipped elsewhere, with the reason): IPC syncs to parity,
sleep frees GPU memory, a sync wakes the server with the new weights, and a LoRA
policy's adapter alone syncs through packed CUDA IPC (written, never run: no GPU here).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch
from tests.vllm.helpers import API_KEY, AUTH, perturb

from ludic.distributed.weight_transfer import create_strategy
from ludic.inference.vllm.client import VLLMChatClient
from ludic.inference.vllm.http import VLLMServerError

pytestmark = pytest.mark.vllm

on_cpu_server = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the session server runs on the GPU here"
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC and vLLM sleep mode need a CUDA GPU"
)


@on_cpu_server
@pytest.mark.parametrize("strategy", ["cuda_ipc", "packed_cuda_ipc"])
def test_a_cpu_server_refuses_cuda_ipc_and_keeps_its_group(served, strategy: str) -> None:
    other = VLLMChatClient(served.server.url, api_key=API_KEY, timeout_s=30.0)
    try:
        with pytest.raises(VLLMServerError, match=r"this server runs on cpu; use the broadcast"):
            other.init_weight_sync(strategy=create_strategy(strategy))
    finally:
        other.close()
    with httpx.Client(base_url=served.server.url, headers=AUTH) as http:
        reply = http.post("/init_communicator", json={"strategy": "carrier_pigeon"})
        assert reply.status_code == 400 and "expected 'broadcast' or one of" in reply.text
        reply = http.post("/init_communicator", json={"strategy": strategy, "world_size": 2})
        assert reply.status_code == 400 and "takes no other field" in reply.text
    # the session client's group is untouched: a sync still lands
    perturb(served.mirror, seed=141)
    version = served.client.get_policy_version() + 1
    served.client.sync_weights(served.mirror.state_dict(), version=version)
    assert served.client.get_policy_version() == version
    served.assert_parity()


@on_cpu_server
def test_sleep_and_wake_need_sleep_mode_and_the_key(served) -> None:
    url = served.server.url
    with httpx.Client(base_url=url) as anonymous:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            assert anonymous.request(method, path).status_code == 401
    with httpx.Client(base_url=url, headers=AUTH) as http:
        for path in ("/sleep", "/sleep?level=2", "/wake_up", "/wake_up?tags=weights"):
            reply = http.post(path)
            assert reply.status_code == 409, reply.text
            assert (
                "started without --enable-sleep-mode" in reply.text and "runs on cpu" in reply.text
            )
        assert http.post("/sleep?level=3").status_code == 400
        assert http.post("/wake_up?tags=everything").status_code == 400
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.get("/admission").json()["open"]  # nothing was closed
    served.assert_parity()  # and it serves


def test_colocated_config_errors_name_the_fields(tmp_path: Path) -> None:
    from tests.faults.helpers import DEMO

    from ludic.run.loading import ConfigError, load_config

    base = [f"output_dir={tmp_path}", "inference.backend=vllm"]
    with pytest.raises(ConfigError, match=r"sync_strategy=cuda_ipc with model.device=cpu"):
        load_config(DEMO, [*base, "inference.vllm.sync_strategy=cuda_ipc"])
    with pytest.raises(ConfigError, match=r"sleep_level=1 .* set sync_strategy: cuda_ipc"):
        load_config(DEMO, [*base, "inference.vllm.sleep_level=1"])
    with pytest.raises(ConfigError, match=r"2 servers need sync_strategy: broadcast"):
        load_config(
            DEMO,
            [*base, "inference.vllm.sync_strategy=packed_cuda_ipc", "inference.vllm.num_servers=2"],
        )
    cuda = [*base, "model.device=cuda", "inference.vllm.sync_strategy=cuda_ipc"]
    with pytest.raises(ConfigError, match=r"sleep_level=2 needs trainer.mode: sync and"):
        load_config(DEMO, [*cuda, "inference.vllm.sleep_level=2", "trainer.publish_every=2"])
    config = load_config(DEMO, [*cuda, "inference.vllm.sleep_level=1"])
    from ludic.run.servers import server_args, sync_strategy

    assert "--enable-sleep-mode" in server_args(config.inference.vllm, cuda=True)
    assert sync_strategy(config.inference.vllm).name == "cuda_ipc"
    assert sync_strategy(load_config(DEMO, base).inference.vllm) is None


# ------------------------------------------------------------------------------ GPU
@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory):
    """A policy server on this GPU with sleep mode and a small memory share, and the
    mirror (the trainer's weights; the IPC sender copies them to this GPU)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'ludic-rl[vllm]')")
    from transformers import AutoModelForCausalLM

    from ludic.inference.vllm.process import start_vllm_server
    from ludic.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("colocated")
    model_dir = save_tiny_model(root / "model")
    server = start_vllm_server(
        model_dir,
        api_key=API_KEY,
        log_path=root / "server.log",
        # float32 as the mirror (vLLM would serve a float32 checkpoint in bf16 on CUDA)
        extra_args=[
            "--gpu-memory-utilization",
            "0.25",
            "--enable-sleep-mode",
            "--dtype",
            "float32",
            "--lora-rank",  # adapter-only syncs too (full-weight syncs work as without)
            "8",
        ],
    )
    mirror = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        yield server, mirror, model_dir
    finally:
        server.stop()


@needs_gpu
@pytest.mark.parametrize("strategy", ["cuda_ipc", "packed_cuda_ipc"])
def test_cuda_ipc_syncs_a_colocated_server_to_parity(colocated, strategy: str) -> None:
    from tests.vllm.helpers import ServedPolicy

    from ludic.models.tiny import build_tiny_tokenizer

    server, mirror, model_dir = colocated
    client = VLLMChatClient(server.url, api_key=API_KEY, timeout_s=60.0)
    try:
        client.init_weight_sync(strategy=create_strategy(strategy))
        perturb(mirror, seed=7 if strategy == "cuda_ipc" else 8)
        version = client.get_policy_version() + 1
        started = time.perf_counter()
        client.sync_weights(mirror.state_dict(), version=version)
        print(
            f"{strategy}: colocated sync of the tiny model in {time.perf_counter() - started:.4f}s"
        )
        assert client.get_policy_version() == version
        assert client.weight_sync.verified == 1  # checksums as loaded on the GPU, and canary
        served = ServedPolicy(server, client, mirror, build_tiny_tokenizer(), model_dir, 1e-3)
        served.assert_parity()
    finally:
        client.close()


@needs_gpu
def test_an_adapter_sync_over_packed_cuda_ipc_is_verified_and_serves_the_policy(
    colocated,
) -> None:
    """The LoRA recipe's path: the peft adapter alone through packed CUDA IPC, loaded by
    vLLM's LoRA support, verified, and serving; a full-weight sync then serves the base."""
    from tests.vllm.helpers import ServedPolicy, peft_policy

    from ludic.distributed.weights import adapter_config, adapter_state_dict
    from ludic.inference.vllm.canary import ModelCanary
    from ludic.models.tiny import build_tiny_tokenizer

    server, mirror, model_dir = colocated
    policy = peft_policy(mirror, seed=10)
    client = VLLMChatClient(server.url, api_key=API_KEY, timeout_s=60.0)
    try:
        client.init_weight_sync(strategy=create_strategy("packed_cuda_ipc"))
        client.set_lora_adapter(adapter_config(policy))
        client.set_canary(ModelCanary(policy), every=1)
        version = client.get_policy_version() + 1
        started = time.perf_counter()
        client.sync_weights(adapter_state_dict(policy), version=version)
        print(f"adapter sync of the tiny model in {time.perf_counter() - started:.4f}s")
        assert client.weight_sync.verified == 1 and client.weight_sync.canary_diffs
        served = ServedPolicy(server, client, policy, build_tiny_tokenizer(), model_dir, 1e-3)
        served.assert_parity()
        client.set_canary(None)
        client.sync_weights(mirror.state_dict(), version=version + 1)
        served.mirror = mirror
        served.assert_parity()
    finally:
        client.close()


@needs_gpu
def test_sleep_frees_the_gpu_and_the_next_sync_wakes_the_server(colocated) -> None:
    from tests.vllm.helpers import ServedPolicy

    from ludic.models.tiny import build_tiny_tokenizer

    server, mirror, model_dir = colocated
    client = VLLMChatClient(server.url, api_key=API_KEY, timeout_s=60.0)
    try:
        client.init_weight_sync(strategy=create_strategy("packed_cuda_ipc"))
        free_before, _ = torch.cuda.mem_get_info()
        client.sleep(level=1)
        assert client.is_sleeping()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep > free_before  # the KV cache (and weights) left the GPU
        perturb(mirror, seed=9)
        version = client.get_policy_version() + 1
        assert "woken" in client.sync_weights(mirror.state_dict(), version=version)
        assert not client.is_sleeping() and client.get_policy_version() == version
        served = ServedPolicy(server, client, mirror, build_tiny_tokenizer(), model_dir, 1e-3)
        served.assert_parity()  # generation resumed, on the synced weights
    finally:
        client.close()
