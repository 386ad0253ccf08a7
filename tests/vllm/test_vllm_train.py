"""`ludic train` with the vLLM backend: a real server, weights synced every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ludic import jobs
from ludic.run.loading import load_config

pytestmark = pytest.mark.vllm

DEMO = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"


def test_train_with_the_vllm_backend_syncs_every_step(tmp_path: Path, monkeypatch) -> None:
    """A LoRA policy (``model.lora``), published as its adapter alone (the default
    ``model.lora.sync: adapter``): the server ludic starts takes ``--lora-rank``, every sync
    is verified (checksums, and the canary on the first) and every sample comes from the
    adapter of its version.

    Also issue 9's finding (tests/faults/test_train_api_key.py): with a key in the
    environment the server inherited it and the trainer's clients did not send it (HTTP
    401); the run works, and the key is written neither to the run nor to the server log."""
    monkeypatch.setenv("LUDIC_API_KEY", "env-key-for-the-faults-test")
    config = load_config(
        DEMO,
        [
            f"output_dir={tmp_path}",
            "inference.backend=vllm",
            "warm_start.steps=3",
            "warm_start.num_demos=8",
            "warm_start.batch_size=8",
            "trainer.steps=3",
            "trainer.prompts_per_step=2",
            "algorithm.group_size=2",
            "eval.num_problems=4",
            "logging.console_every=1",
            "env.kwargs.num_problems=8",
            "model.lora.r=8",
        ],
    )
    assert config.model.lora is not None and config.model.lora.sync == "adapter"
    run_dir = jobs.train(config)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["phase"] == "rl"]
    assert [r["policy_version"] for r in rl] == [1, 2, 3]
    # Step k's rollouts were sampled by the server holding version k-1: the trainer
    # published after the warm start (version 0) and after every step.
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        versions = {s["trace"]["policy_version"] for s in sample["steps"] if s["kind"] == "agent"}
        assert versions == {sample["step"] - 1}
    for name in ("config.yaml", "vllm_server.log"):
        assert "env-key-for-the-faults-test" not in (run_dir / name).read_text(errors="replace")
    log = (run_dir / "vllm_server.log").read_text(errors="replace")
    # every publish (after the warm start and each step) an adapter sync: a server without
    # --lora-rank answers 409
    assert log.count('"POST /lora_adapter HTTP/1.1" 200') == 4


def test_async_train_on_vllm_with_partial_rollouts_stays_within_max_staleness(
    served, tmp_path: Path
) -> None:
    # No warm start: the random tiny model writes long completions (up to max_tokens), so
    # each publish (pause, abort, sync, resume) lands while the next batch is generating.
    # Against the session server (the same tiny model; the run publishes its own weights
    # as version 0 before its first batch): the test above starts its own.
    config = load_config(
        DEMO,
        [
            f"output_dir={tmp_path}",
            *served.run_overrides(),
            "inference.vllm.partial_rollouts=continue",
            "trainer.mode=async",
            "trainer.max_staleness=1",
            "warm_start.steps=0",
            "trainer.steps=8",
            "trainer.prompts_per_step=2",
            "algorithm.group_size=4",
            "sampling.max_tokens=256",
            "eval.num_problems=2",
            "logging.console_every=1",
            "logging.num_sample_rollouts=8",
            "env.kwargs.num_problems=8",
        ],
    )
    try:
        run_dir = jobs.train(config)
    finally:
        served.take_back()
    served.assert_parity()

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(1, 9))
    for r in rl:  # step s trains with version s - 1: nothing older than s - 1 - 1
        assert 0 <= r["staleness/max"] <= 1 and r["dropped/stale"] == 0, r
        assert r["policy_version"] == r["step"]
    # Every trace is consistent: versions never go backwards, and none is older than
    # the step's bound. (Whether a publish lands mid-generation depends on timing; the
    # exact continuation across one is tested in test_vllm_partial.py.)
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples:
        for s in (s for s in sample["steps"] if s["kind"] == "agent"):
            trace = s["trace"]
            n = len(trace["completion_token_ids"])  # a version alone stands for every token
            versions = trace["completion_versions"] or [trace["policy_version"]] * n
            assert len(versions) == n
            assert versions == sorted(versions) and versions[0] == trace["policy_version"]
            assert sample["step"] - 2 <= versions[0] and versions[-1] <= sample["step"] - 1
    spans = [r["staleness/version_span_max"] for r in rl]
    assert all(0 <= span <= 1 for span in spans)  # a completion straddles at most η updates


def test_two_trainer_ranks_publish_to_two_pinned_servers(tmp_path: Path) -> None:
    # trainer.world_size=2 (FSDP2, gloo) and inference.vllm.num_servers=2 (one core each,
    # behind a VLLMClientPool): rank 0 gathers the sharded weights and pushes them to both
    # servers each step through one weight-sync group spanning both; every step's rollouts
    # come from the version of the step before, whichever server sampled them, and both
    # servers sample.
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "ludic", "train", str(DEMO), f"output_dir={tmp_path}"]
    command += [
        "inference.backend=vllm",
        "inference.vllm.num_servers=2",
        "inference.vllm.publish=one_group",
        "inference.vllm.cpu_cores=[0,1]",
        "trainer.world_size=2",
        "warm_start.steps=0",
        "trainer.steps=2",
        "trainer.prompts_per_step=4",
        "algorithm.group_size=2",
        "sampling.max_tokens=8",
        "eval.num_problems=2",
        "logging.console_every=1",
        "logging.num_sample_rollouts=8",
        "env.kwargs.num_problems=8",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [x.split(": ", 1)[1] for x in done.stdout.splitlines() if x.startswith("run directory: ")]
    run_dir = Path(ran[-1])  # the CLI's last line (the console's first one may wrap)

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in lines if r["phase"] == "rl"] == [1, 2]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    servers = set()
    for sample in samples:
        agent_steps = [s for s in sample["steps"] if s["kind"] == "agent"]
        assert {s["trace"]["policy_version"] for s in agent_steps} == {sample["step"] - 1}
        servers |= {s["info"]["server"] for s in agent_steps}
    assert len(servers) == 2, servers
    for i, core in enumerate([0, 1]):  # vLLM's worker bound its OpenMP threads there
        log = (run_dir / f"vllm_server_{i}.log").read_text()
        assert f"core ids=[{core}]" in log, log[-2000:]


def test_a_bogus_extra_arg_fails_in_seconds_with_the_servers_own_error_line(
    tmp_path: Path, capsys
) -> None:
    """vLLM's argparse stops the server seconds in; the run reports that one line (not the
    3 KB usage text before it) with the log's path, as a config error naming the section."""
    import time

    from ludic.cli import main

    started = time.monotonic()
    code = main(
        [
            "train",
            str(DEMO),
            f"output_dir={tmp_path}",
            "inference.backend=vllm",
            "inference.vllm.extra_args=[--bogus-flag]",
            "warm_start.steps=0",
        ]
    )
    assert code == 2 and time.monotonic() - started < 90
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and len(lines[0]) < 400, lines
    log = next(tmp_path.glob("*/vllm_server.log"))
    assert lines[0].startswith("error: inference.vllm: vLLM server for http://127.0.0.1:")
    assert lines[0].endswith(
        "exited with code 2 before becoming healthy: __main__.py: error: unrecognized "
        f"arguments: --bogus-flag (log: {log}); check inference.vllm.extra_args"
    )
