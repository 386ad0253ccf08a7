"""No silent hangs: a sync whose server stops answering, whose trainer stalls in the middle
of a transfer, or whose trainer is SIGKILLed mid-sync ends within its deadline. The trainer
side raises ``SyncStageError`` naming the stage, the server and its ranks, and the bytes
sent so far; the server keeps serving and takes a new group. (A worker SIGKILLed mid-sync:
``test_vllm_verify.py``.) Each test forms its own group with a short timeout on the session
server, and gives the session's client a new group afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.vllm.helpers import API_KEY, AUTH, AfterAnnounce  # noqa: E402

from ludic.distributed.weight_transfer import ModelWeightExtractor, free_port  # noqa: E402
from ludic.inference.vllm.client import VLLMChatClient  # noqa: E402
from ludic.inference.vllm.weight_sync import (  # noqa: E402
    SyncStageError,
    SyncStageTimeout,
)

TIMEOUT_S = 3.0


@pytest.fixture
def short_group(served):
    """A client of the session server with its own group and a 3 s timeout; afterwards the
    session's client gets a new group and the mirror's weights, and serves them."""
    client = VLLMChatClient(served.server.url, api_key=API_KEY, timeout_s=TIMEOUT_S, max_retries=0)
    client.init_weight_sync(master_port=free_port())
    client.publisher.extractor = ModelWeightExtractor(chunk_bytes=200_000)  # several chunks
    try:
        yield client
    finally:
        client.close()
        served.client.close()
        _until_idle(served.server.url)
        served.connect()
        served.client.sync_weights(served.mirror.state_dict(), version=60)
        served.assert_parity()


def _until_idle(url: str, timeout_s: float = 30.0) -> dict:
    """The server's control plane once it has no background task left (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = httpx.post(f"{url}/get_num_background_tasks", headers=AUTH, timeout=5).json()
        if status["num_background_tasks"] == 0 or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_a_stopped_server_fails_the_sync_in_the_announce_stage(served, short_group):
    """SIGSTOP the server's API process: the first announcement gets no answer, and the
    sync fails after the client's timeout naming the stage, the server and its rank."""
    state = served.mirror.state_dict()
    total_mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    os.kill(served.server.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(SyncStageTimeout) as caught:
            short_group.sync_weights(state, version=61)
    finally:
        os.kill(served.server.pid, signal.SIGCONT)
    assert time.monotonic() - started < 2 * TIMEOUT_S + 5
    message = str(caught.value)
    assert caught.value.stage == "announce" and "stage 'announce'" in message
    assert f"{served.server.url} (rank 1)" in message
    assert f"0.0 of {total_mib:.1f} MiB sent" in message


def test_a_trainer_stalled_mid_transfer_fails_in_the_broadcast_stage(served, short_group):
    """The trainer stalls after announcing its third chunk, longer than the group timeout:
    the worker gives up the chunk, and the trainer's own collective then fails naming the
    broadcast stage and the bytes it had sent. The server keeps serving."""
    publisher = short_group.publisher
    publisher.control = AfterAnnounce(publisher.control, 3, lambda: time.sleep(TIMEOUT_S + 2))
    started = time.monotonic()
    with pytest.raises(SyncStageError) as caught:
        short_group.sync_weights(served.mirror.state_dict(), version=62)
    assert time.monotonic() - started < 4 * TIMEOUT_S + 10
    message = str(caught.value)
    assert caught.value.stage == "broadcast" and served.server.url in message
    assert caught.value.progress.bytes_moved > 0  # two chunks had gone out
    assert httpx.get(f"{served.server.url}/health").json()["status"] == "ok"


TRAINER = """
import sys, time
from safetensors.torch import load_file
from ludic.distributed.weight_transfer import ModelWeightExtractor
from ludic.inference.vllm.client import VLLMChatClient

from tests.vllm.helpers import AfterAnnounce

url, key, port, model = sys.argv[1:5]
client = VLLMChatClient(url, api_key=key, timeout_s=3.0)
client.init_weight_sync(master_port=int(port))
client.publisher.extractor = ModelWeightExtractor(chunk_bytes=200_000)

def wait_for_the_kill():
    print("announced", flush=True)
    time.sleep(600)  # SIGKILLed here

client.publisher.control = AfterAnnounce(client.publisher.control, 2, wait_for_the_kill)
client.sync_weights(load_file(f"{model}/model.safetensors"), version=63)
"""


def test_a_trainer_sigkilled_mid_sync_leaves_a_server_that_serves_and_takes_a_new_group(served):
    """A trainer process forms a group and is SIGKILLed after announcing two chunks: the
    worker's pending receive ends within the group timeout, the server records the failure,
    answers /health and serves, and the session's client forms a new group and syncs."""
    served.client.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, served.server.url, API_KEY, str(free_port()),
         str(served.model_dir)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "announced"
        before = httpx.post(f"{served.server.url}/get_num_background_tasks", headers=AUTH).json()[
            "error_count"
        ]
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        started = time.monotonic()
        status = _until_idle(served.server.url)
        assert status["num_background_tasks"] == 0 and time.monotonic() - started < 30
        assert status["error_count"] > before  # the receive failed, and was recorded
        assert httpx.get(f"{served.server.url}/health").json()["status"] == "ok"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        served.connect()
    served.client.sync_weights(served.mirror.state_dict(), version=63)
    served.assert_parity()
