"""Shared fixtures: a tiny byte-level tokenizer and a tiny Qwen2 model built locally, and
(``served``) the session's real vLLM policy server, started on first use.

Every test stays on loopback: a local Ray runs local-only (node address 127.0.0.1, set
before anything imports ray; every process a test starts inherits it), and a test fails
if a process it started listens beyond loopback (:mod:`tests.loopback`)."""

from __future__ import annotations

import os
import time

import pytest

from ludic.pipeline.ray_local import LOCAL_ONLY_ENV

os.environ.update(LOCAL_ONLY_ENV)  # before ray is imported: Ray reads it then

from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh randomly initialised tiny Qwen2 causal LM (seed 0) per test."""
    return build_tiny_causal_lm(tiny_tokenizer, seed=0)


@pytest.fixture(scope="session")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import torch
    from tests.session_servers import start_early, stop_untaken
    from tests.vllm.helpers import ServedPolicy
    from tests.vllm_reward.helpers import start_reward_server
    from transformers import AutoModelForCausalLM

    from ludic.models.tiny import build_tiny_tokenizer, save_tiny_model

    # the reward server starts alongside (if a collected test uses it): two start-ups at
    # once cost about one on two cores
    reward_root = tmp_path_factory.mktemp("vllm_reward")
    start_early(
        request.config, "served_reward", lambda: start_reward_server(reward_root, wait=False)
    )
    root = tmp_path_factory.mktemp("vllm")
    model_dir = save_tiny_model(root / "model")
    served = ServedPolicy(None, None, None, build_tiny_tokenizer(), model_dir, root=root)
    served.server_args = ("--weight-load-roots", str(root / "disk"))  # test_vllm_disk_load
    try:
        served.start()
    except BaseException:
        stop_untaken(request.config)
        raise
    served.mirror = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        yield served
    finally:
        stop_untaken(request.config)
        served.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One real redis-server for the session (started on first use); each test uses its
    own prefix."""
    from tests.pipeline.helpers import running_redis

    yield from running_redis(tmp_path_factory.mktemp("redis"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.session_servers import note_fixtures

    note_fixtures(config, items)


@pytest.fixture(autouse=True)
def _compute_thread_idle_after_test():
    """No test leaves work running on ludic's compute thread: such work would race the
    next test for the global torch RNG (and the CPU). Cancelled calls stop at their next
    check, so a few seconds is plenty."""
    from ludic._async import compute_calls_in_flight

    yield
    deadline = time.monotonic() + 10.0
    while compute_calls_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compute_calls_in_flight() == 0, "the test left work running on the compute thread"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """The loopback guard: sampled while the test body runs, checked when it ends (its
    fixtures, and the servers they hold, still up)."""
    from tests.loopback import Sampler

    sampler = Sampler().start()
    try:
        return (yield)
    finally:
        if found := sampler.stop():
            lines = "\n".join(f"  {listener}" for listener in found)
            pytest.fail(f"listening beyond loopback (tests stay on 127.0.0.1):\n{lines}")
