"""Every sync is verified (``inference.vllm.verify_sync: every``, the default): the server's
workers report the sums of each tensor as received and of each served parameter as loaded
(a CPU worker reads a layer just before vLLM pre-packs it), and the trainer checks them
against what it sent. Faults: a loader that changes one value, one that skips a tensor,
and a worker killed mid-sync, then its server restarted, each fail the sync with an error
naming the server, the tensor (or the stage, or the restart) and the version. The session server runs the tests' worker
extension (``tests.vllm.fault_worker``), whose fault switch is off outside these tests."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
from tests.vllm.helpers import API_KEY, AfterAnnounce, assert_all_gone, perturb  # noqa: E402

from ludic.distributed.weight_transfer import ModelWeightExtractor  # noqa: E402
from ludic.distributed.weight_transfer.verify import SyncVerificationError  # noqa: E402
from ludic.inference.request import CompletionRequest  # noqa: E402
from ludic.inference.vllm.client import VLLMChatClient, VLLMServerError  # noqa: E402
from ludic.inference.vllm.weight_sync import SyncStageError  # noqa: E402


def test_every_sync_is_verified_and_the_report_covers_every_tensor(served):
    perturb(served.mirror, seed=41)
    sync = served.client.weight_sync
    before = sync.verified
    served.client.sync_weights(served.mirror.state_dict(), version=41)
    assert sync.verified == before + 1
    (report,) = served.client.control.weight_report()["workers"]
    assert report["version"] == 41
    assert set(report["received"]) == set(served.mirror.state_dict())
    loaded_parts = {p for entry in report["loaded"].values() for p in entry["parts"]}
    assert loaded_parts | set(report["unverified"]) == set(served.mirror.state_dict())
    # the fused layers were read back fused (before vLLM pre-packed them)
    qkv = report["loaded"]["model.layers.0.self_attn.qkv_proj.weight"]
    assert len(qkv["parts"]) == 3 and qkv["checksum"] == qkv["expected"]
    served.assert_parity()


@pytest.mark.parametrize(
    ("fault", "tensor", "named"),
    [
        ("corrupt", "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"),
        ("skip", "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj"),
        ("skip", "model.norm.weight", "model.norm.weight"),
    ],
)
def test_a_loader_that_changes_or_skips_a_tensor_fails_the_sync_naming_it(
    served, fault, tensor, named
):
    perturb(served.mirror, seed=42)
    served.fault_file.write_text(f"{fault} {tensor}")
    try:
        with pytest.raises(SyncVerificationError) as caught:
            served.client.sync_weights(served.mirror.state_dict(), version=42)
    finally:
        served.fault_file.unlink()
    message = str(caught.value)
    assert served.server.url in message and named in message and "version 42" in message
    # the next sync, with an intact loader, is verified and the server serves the mirror
    served.client.sync_weights(served.mirror.state_dict(), version=43)
    served.assert_parity()


def test_verify_sync_first_and_off_check_no_later_sync(served):
    """What the settings mean: with ``off`` (or ``first``, after the first sync) a corrupt
    load goes unnoticed; the default would have stopped it (above)."""
    sync = served.client.weight_sync
    assert sync.syncs > 0 and sync.verify_sync == "every"
    for setting in ("first", "off"):
        sync.verify_sync = setting
        served.fault_file.write_text("corrupt model.norm.weight")
        try:
            served.client.sync_weights(served.mirror.state_dict(), version=44)
        finally:
            served.fault_file.unlink()
            sync.verify_sync = "every"
    served.client.sync_weights(served.mirror.state_dict(), version=45)
    served.assert_parity()


def test_a_worker_killed_mid_sync_then_a_restart_fail_each_sync_naming_the_cause(served):
    """The session server's worker process (the one holding the model) is SIGKILLed after
    the trainer announced three chunks: the sync raises within
    the client's timeout, naming the stage, the server and its rank, and ``stop()`` reaps
    what is left. The server then starts again on its port, with its checkpoint's weights:
    the trainer's next sync fails naming the server and the restart. (The session server
    is the restarted one afterwards, with a new group and the mirror's weights.)"""
    served.client.close()
    server = served.server
    pids = [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]
    assert len(pids) >= 2  # API server, engine core (the worker, on CPU)
    worker = _worker(server.pid)
    timeout_s = 20.0
    client = VLLMChatClient(server.url, api_key=API_KEY, timeout_s=timeout_s, max_retries=2)
    try:
        client.init_weight_sync(master_port=server.group_port)
        publisher = client.publisher
        publisher.extractor = ModelWeightExtractor(chunk_bytes=20_000)
        announced = threading.Event()

        def kill_the_worker() -> None:
            os.kill(worker, signal.SIGKILL)
            announced.set()

        publisher.control = AfterAnnounce(publisher.control, 3, kill_the_worker)
        perturb(served.mirror, seed=46)
        started = time.monotonic()
        with pytest.raises(SyncStageError) as caught:
            client.sync_weights(served.mirror.state_dict(), version=46)
        assert announced.is_set()
        assert time.monotonic() - started < timeout_s + 10
        assert caught.value.stage in ("announce", "broadcast", "load")
        assert f"{server.url} (rank 1)" in str(caught.value) and "version 46" in str(caught.value)
        started = time.monotonic()
        with pytest.raises((ConnectionError, VLLMServerError)):
            asyncio.run(client.complete(CompletionRequest((1, 2, 3))))
        assert time.monotonic() - started < timeout_s
        server.stop()
        assert_all_gone(pids)
        assert not server.is_running()

        served.start_server(port=server.port)
        with pytest.raises(SyncVerificationError, match="restarted") as caught:
            client.sync_weights(served.mirror.state_dict(), version=47)
        assert served.server.url in str(caught.value) and "version 47" in str(caught.value)
    finally:
        client.close()
        served.connect()
    served.client.sync_weights(served.mirror.state_dict(), version=47)
    served.assert_parity()


def _worker(api_pid: int) -> int:
    """The pid of the server's worker process (``VLLM::Worker``; where vLLM runs the worker
    inside its engine core, that one)."""
    children = psutil.Process(api_pid).children(recursive=True)
    for title in ("Worker", "EngineCore"):
        for child in children:
            with contextlib.suppress(psutil.Error):
                if title in child.name() + " ".join(child.cmdline()):
                    return child.pid
    raise AssertionError(f"no worker among {[c.name() for c in children]}")


def test_the_canary_catches_what_the_checksums_cannot_see(served):
    """A loader that swaps two rows of a tensor keeps its sums: the checksums pass, and the
    canary (the server's logprobs of fixed tokens against the trainer's) names the sync."""
    from ludic.inference.vllm.canary import ModelCanary

    served.client.set_canary(ModelCanary(served.mirror), every=1)
    try:
        served.client.sync_weights(served.mirror.state_dict(), version=47)
        ((version, worst),) = served.client.weight_sync.canary_diffs[-1:]
        assert version == 47 and worst < 1e-4  # float32 server and trainer
        served.fault_file.write_text("permute model.layers.1.mlp.down_proj.weight")
        try:
            with pytest.raises(SyncVerificationError, match="canary") as caught:
                served.client.sync_weights(served.mirror.state_dict(), version=48)
        finally:
            served.fault_file.unlink()
        assert served.server.url in str(caught.value) and "version 48" in str(caught.value)
        served.client.sync_weights(served.mirror.state_dict(), version=49)
    finally:
        served.client.set_canary(None)
    served.assert_parity()


def test_a_run_whose_server_corrupts_a_tensor_stops_naming_it(served, tmp_path):
    """``ludic train``'s path (``jobs.train``) against the session server, whose loader
    corrupts one value: the run's first publish fails verification and the run stops with
    the error naming the server, the version and the tensor. (A server the run started is
    stopped on any failure: ``tests/faults/test_crash_resume_vllm.py``.)"""
    from tests.faults.helpers import DEMO

    from ludic import jobs
    from ludic.run.loading import load_config

    config = load_config(
        DEMO,
        [
            f"output_dir={tmp_path}",
            *served.run_overrides(),
            "warm_start.steps=0",
            "trainer.steps=2",
            "eval.every=0",
        ],
    )
    served.fault_file.write_text("corrupt model.norm.weight")
    try:
        with pytest.raises(SyncVerificationError, match=r"version 0, .*'model\.norm\.weight'"):
            jobs.train(config)
    finally:
        served.fault_file.write_text("")
        served.take_back()
    served.assert_parity()
