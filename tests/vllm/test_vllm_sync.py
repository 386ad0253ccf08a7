"""Live weight sync into the session vLLM server over a gloo group (trainer = this process):
the served model must equal transformers on the pushed weights, and bad updates must fail
loudly on both sides while the server keeps serving its previous weights."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from tests.vllm.helpers import perturb  # noqa: E402

from ludic.distributed.weight_transfer import (  # noqa: E402
    ModelWeightExtractor,
    WeightTransferError,
)
from ludic.inference.vllm.client import VLLMServerError  # noqa: E402
from ludic.training.flat_parameters import flatten_parameters  # noqa: E402


def test_full_sync_matches_transformers_on_the_new_weights(served):
    before = served.complete().trace
    version = served.client.get_policy_version() + 1
    perturb(served.mirror, seed=1)
    status = served.client.sync_weights(served.mirror.state_dict(), version=version)
    assert f"version {version}" in status
    after = served.assert_parity().trace
    assert served.client.get_policy_version() == version
    assert after.policy_version == version
    # the update took effect: same prompt, different model
    changed = before.completion_token_ids != after.completion_token_ids or max(
        abs(a - b) for a, b in zip(before.completion_logprobs, after.completion_logprobs)
    )
    assert changed


def test_a_second_sync_works_and_bumps_the_version(served):
    version = served.client.get_policy_version()
    perturb(served.mirror, seed=2)
    served.client.sync_weights(served.mirror.state_dict(), version=version + 1)
    served.assert_parity()
    assert served.client.get_policy_version() == version + 1


def test_syncing_one_module_updates_only_that_module(served):
    version = served.client.get_policy_version()
    perturb(served.mirror.model.layers[0].mlp, seed=3, scale=0.5)
    subset = {
        name: t
        for name, t in served.mirror.state_dict().items()
        if name.startswith("model.layers.0.mlp.")
    }
    assert len(subset) == 3
    served.client.sync_weights(subset, version=version + 1)
    served.assert_parity()
    assert served.client.get_policy_version() == version + 1


class RecordingControl:
    """The client's control plane, recording every announced request as JSON."""

    def __init__(self, inner) -> None:
        self.inner, self.announced = inner, []

    def announce(self, request) -> None:
        self.announced.append(request.to_dict())
        self.inner.announce(request)

    def wait_until_applied(self, timeout_s: float) -> None:
        self.inner.wait_until_applied(timeout_s)


def test_flat_parameters_sync_and_later_syncs_announce_layouts_by_id(served):
    """A mirror kept flat (flatten_parameters) syncs to parity; its second sync announces
    every chunk by layout id only, over HTTP to the worker, and still matches."""
    publisher = served.client.publisher
    original_extractor, original_control = publisher.extractor, publisher.control
    publisher.extractor = ModelWeightExtractor(chunk_bytes=200_000)
    publisher.control = recording = RecordingControl(original_control)
    try:
        flatten_parameters(served.mirror)
        version = served.client.get_policy_version()
        for step in (1, 2):
            perturb(served.mirror, seed=10 + step)
            served.client.sync_weights(served.mirror.state_dict(), version=version + step)
            served.assert_parity()
        assert served.client.get_policy_version() == version + 2
    finally:
        publisher.extractor, publisher.control = original_extractor, original_control
    half = len(recording.announced) // 2
    first, second = recording.announced[:half], recording.announced[half:]
    assert half > 3 and all(a["names"] and a["layout"] for a in first)
    assert [a["layout"] for a in second] == [a["layout"] for a in first]
    assert all(a["names"] == [] for a in second)


def test_a_sync_split_into_many_chunks_matches(served):
    """Tiny chunks put q/k/v (one fused vLLM layer) in different chunks."""
    publisher = served.client.publisher
    original = publisher.extractor
    publisher.extractor = ModelWeightExtractor(chunk_bytes=20_000)
    try:
        chunks = list(publisher.extractor.extract_state_dict(served.mirror.state_dict()))
        assert len(chunks) > 10
        perturb(served.mirror, seed=4)
        served.client.sync_weights(served.mirror.state_dict(), version=100)
    finally:
        publisher.extractor = original
    served.assert_parity()
    assert served.client.get_policy_version() == 100


class _TamperingControl:
    """Announces a request whose first shape differs from the tensors sent."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def announce(self, request) -> None:
        request.shapes[0] = [request.shapes[0][0] + 1, *request.shapes[0][1:]]
        self.inner.announce(request)

    def wait_until_applied(self, timeout_s: float) -> None:
        self.inner.wait_until_applied(timeout_s)


@contextlib.contextmanager
def _control(served, control):
    publisher = served.client.publisher
    original, publisher.control = publisher.control, control
    try:
        yield
    finally:
        publisher.control = original


def test_metadata_mismatch_fails_on_both_sides_and_the_server_keeps_serving(served):
    version = served.client.get_policy_version()
    update = {
        name: t + 1.0
        for name, t in served.mirror.state_dict().items()
        if name.startswith("model.layers.1.mlp.")
    }
    with (
        _control(served, _TamperingControl(served.client.control)),
        pytest.raises(WeightTransferError, match="rejected") as info,
    ):
        served.client.sync_weights(update, version=version + 1)
    # the trainer's error carries the server's side of the story
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "weight update rejected" in notes and "announced" in notes
    assert served.client.get_policy_version() == version
    served.assert_parity()  # old weights, still serving
    perturb(served.mirror, seed=5)  # and the group still works
    served.client.sync_weights(served.mirror.state_dict(), version=version + 1)
    served.assert_parity()


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"model.layers.0.mlp.bogus.weight": torch.zeros(3)}, "checkpoint does not have"),
        ({"model.layers.0.mlp.down_proj.weight": torch.zeros(3, 4)}, r"shape \[3, 4\]"),
        ({"model.layers.1.self_attn.q_proj.weight": torch.zeros(128, 128)}, "fused layer"),
    ],
    ids=["unknown-name", "wrong-shape", "part-of-a-fused-layer"],
)
def test_an_update_the_model_cannot_take_is_refused_before_loading(served, update, match):
    version = served.client.get_policy_version()
    with pytest.raises(VLLMServerError, match=match) as info:
        served.client.sync_weights(update, version=version + 1)
    assert "Nothing was loaded" in info.value.server_error
    assert served.client.get_policy_version() == version
    served.assert_parity()


def test_update_param_batch_rejects_malformed_requests(served):
    control = served.client.control
    with pytest.raises(VLLMServerError, match="unknown weight update request kind") as info:
        control.post("/update_param_batch", {"kind": "pickle", "names": []})
    assert info.value.status_code == 400
    group = {"master_addr": "127.0.0.1", "master_port": 1}
    for bad, match in [
        ({"world_size": 1}, "world_size=1"),  # no room for a worker
        ({"world_size": 3, "rank_offset": 3}, "rank_offset=3"),  # first worker out of range
        ({"world_size": 3, "rank_offset": 0}, "rank_offset=0"),  # the trainer's rank
    ]:
        with pytest.raises(VLLMServerError, match=match) as info:
            control.post("/init_communicator", {**group, **bad})
        assert info.value.status_code == 400
    assert control.post("/get_num_background_tasks")["num_background_tasks"] == 0


def test_after_close_a_new_trainer_can_form_a_new_group(served):
    """Runs last in this module: it replaces the session client."""
    from ludic.inference.vllm.client import VLLMChatClient

    old = served.client
    old.close()  # leaves the group; the server closes its side too
    with pytest.raises(RuntimeError, match="init_weight_sync"):
        old.sync_weights(served.mirror.state_dict(), version=1)
    new = VLLMChatClient(served.server.url, api_key=old.api_key, timeout_s=60.0)
    with pytest.raises(VLLMServerError, match="init_communicator") as info:
        new.control.post(
            "/update_param_batch", {"kind": "broadcast", "names": [], "dtypes": [], "shapes": []}
        )
    assert info.value.status_code == 409
    new.init_weight_sync()
    served.client = new
    version = new.get_policy_version()
    perturb(served.mirror, seed=6)
    new.sync_weights(served.mirror.state_dict(), version=version + 1)
    served.assert_parity()
