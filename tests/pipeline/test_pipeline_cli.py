"""``ludic train`` with ``trainer.mode: pipeline``, ``ludic learner`` and ``ludic actor`` on a
tiny budget: real processes, a real redis-server, the tiny model on the transformers backend
(weights through Redis)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
import torch
from tests.faults.helpers import DEMO, TINY
from tests.pipeline.helpers import require_redis_server

from ludic import cli, jobs
from ludic.inference.vllm.process import die_with_parent_preexec
from ludic.pipeline.redis_queue import RedisBatchQueue
from ludic.pipeline.redis_server import start_redis_server
from ludic.pipeline.redis_weights import decode_weights
from ludic.run.loading import ConfigError, load_config
from ludic.run.models import load_policy
from ludic.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.redis

# The faults tests' tiny budget (DEMO, TINY), in pipeline mode.
TINY = [*TINY, "trainer.mode=pipeline", "trainer.max_staleness=1"]


def _overrides(out: Path, *extra: str) -> list[str]:
    return [f"output_dir={out}", *TINY, *extra]


def _records(run_dir: Path, phase: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def _queue(url: str, prefix: str) -> RedisBatchQueue:
    return RedisBatchQueue(url, prefix=prefix, reconnect_timeout_s=5.0)


def _ludic(*argv: str, out: Path, name: str) -> subprocess.Popen:
    """``ludic ARGV`` in its own session, stopped (SIGTERM) if this test process dies
    first: a killed pytest must not leave a 10000-step run loading the machine."""
    return subprocess.Popen(
        [sys.executable, "-m", "ludic", *argv],
        stdout=(out / f"{name}.out").open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
        preexec_fn=die_with_parent_preexec(os.getpid()),
    )


def _assert_every_step_trained_once_within_staleness(run_dir: Path, q: RedisBatchQueue) -> None:
    rl = _records(run_dir, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    for r in rl:
        assert r["policy_version"] == r["step"]
        assert 0 <= r["staleness/max"] <= 1 and r["dropped/stale"] == 0
    trained = q.records("trained")
    assert sorted(r["version"] for r in trained.values()) == [1, 2, 3, 4]
    assert q.queued() == 0 and q.client.llen(q.processing_key) == 0
    c = q.counters()
    assert c["trained_batches"] == 4
    # every batch an actor pushed was trained, queued when the run ended, or dropped as
    # stale with its reason (two actors can each be a batch ahead: under load one batch
    # was seen made at version 1 and taken at version 3)
    dropped = q.records("dropped")  # P:dropped holds batches whose items all were stale
    assert all(r["dropped_items"] > 0 for r in dropped.values()), dropped
    assert set(q.records("produced")) == set(trained) | set(q.records("unused")) | set(dropped)
    assert q.is_done() and q.learner_info() is None


def test_one_command_pipeline_with_two_actors_trains_every_step_within_max_staleness(
    redis_server, tmp_path: Path
) -> None:
    prefix = f"cli-{time.monotonic_ns()}"
    config = load_config(
        DEMO,
        _overrides(
            tmp_path,
            "pipeline.num_actors=2",
            f"pipeline.redis_url={redis_server.url}",
            f"pipeline.prefix={prefix}",
            "algorithm.kl_coef=0.1",
        ),
    )
    started = time.monotonic()
    run_dir = jobs.train(config)
    print(f"one-command pipeline run: {time.monotonic() - started:.1f}s")
    q = _queue(redis_server.url, prefix)
    _assert_every_step_trained_once_within_staleness(run_dir, q)
    assert {r["actor_id"] for r in q.records("produced").values()} <= {"actor-0", "actor-1"}
    assert [r["step"] for r in _records(run_dir, "warm_start")] == [1, 2]
    assert [r["step"] for r in _records(run_dir, "eval")] == [0, 4]
    for name in ("learner", "actor-0", "actor-1"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    assert "pushed" in (run_dir / "logs" / "actor-0.log").read_text()
    # the learner's KL reference is the warm-started policy, kept in the run directory
    assert (run_dir / "reference" / "config.json").is_file()
    kl = [r["loss/kl/kl"] for r in _records(run_dir, "rl")]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and max(kl) > 0

    # The weights the actors would load next are the learner's final ones (the checkpoint).
    tensors, version = decode_weights(q.client.get(q.keys.weights))
    assert version == 4
    policy, _ = load_policy(config, run_dir / "model")
    load_checkpoint(run_dir / "checkpoints" / "rl" / "step_00000004", policy)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensors[name], tensor), name


def test_learner_and_actor_commands_run_as_separate_processes(tmp_path: Path) -> None:
    """No pipeline.redis_url: the learner starts its own redis-server and the actor finds
    it through RUN_DIR/pipeline.json (both started at once: the actor waits)."""
    require_redis_server()
    run_dir = tmp_path / "run"
    common = [str(DEMO), *_overrides(tmp_path), "--run-dir", str(run_dir)]
    learner = _ludic("learner", *common, out=tmp_path, name="learner")
    actor = _ludic("actor", *common, "--actor-id", "solo", out=tmp_path, name="actor")
    try:
        assert learner.wait(timeout=240) == 0, (tmp_path / "learner.out").read_text()[-3000:]
        assert actor.wait(timeout=60) == 0, (tmp_path / "actor.out").read_text()[-3000:]
    finally:
        for process in (learner, actor):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert "actor solo: pushed" in (tmp_path / "actor.out").read_text()
    info = json.loads((run_dir / "pipeline.json").read_text())
    assert info["prefix"] == run_dir.name  # the default prefix: the run's name
    # the learner's Redis had a password: kept out of pipeline.json, readable by its user
    assert info["redis_url"].startswith("redis://:***@127.0.0.1:")
    secret = run_dir / "redis_password"
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text()) >= 24
    server = start_redis_server(run_dir / "redis")  # what the learner's Redis kept (AOF)
    try:
        q = _queue(server.url, prefix=run_dir.name)
        _assert_every_step_trained_once_within_staleness(run_dir, q)
        assert {r["actor_id"] for r in q.records("produced").values()} == {"solo"}
    finally:
        server.stop()


def _start_long_run(out: Path) -> tuple[subprocess.Popen, Path, list[psutil.Process]]:
    """``ludic train`` (pipeline, local redis-server, 2 actors) until its first RL step:
    the parent, the run directory and every process under the parent."""
    require_redis_server()
    parent = _ludic(
        "train",
        str(DEMO),
        *_overrides(
            out,
            "trainer.steps=10000",
            "warm_start.steps=0",
            "pipeline.num_actors=2",
            # a learner whose Redis died with the parent gives up in 10 s, not 60 (the
            # kill -9 test waits 60 s for every child, on a loaded machine too)
            "pipeline.reconnect_timeout_s=10",
        ),
        out=out,
        name="train",
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = list(out.glob("arithmetic-demo-*/metrics.jsonl"))
        if found and _records(found[0].parent, "rl"):
            family = psutil.Process(parent.pid).children(recursive=True)
            names = " ".join(" ".join(p.cmdline()[:4]) for p in family)
            assert "redis-server" in names and " learner" in names, names
            # the local Redis has a password, and its URL is on no command line
            assert not any("redis://" in " ".join(p.cmdline()) for p in family)
            server = next(p for p in family if "redis-server" in p.cmdline()[0])
            port = next(c.laddr.port for c in server.net_connections() if c.status == "LISTEN")
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
            assert names.count(" actor") == 2, names
            return parent, found[0].parent, family
        if parent.poll() is not None:
            break
        time.sleep(0.2)
    os.killpg(parent.pid, signal.SIGKILL)
    raise AssertionError(f"no RL step: {(out / 'train.out').read_text()[-3000:]}")


def _kill_all(parent: subprocess.Popen, family: list[psutil.Process]) -> None:
    """Never leave a process behind, even when a test fails."""
    if parent.poll() is None:
        os.killpg(parent.pid, signal.SIGKILL)
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.kill()


def test_kill_9_of_the_one_command_parent_ends_its_children(tmp_path: Path) -> None:
    parent, _run_dir, family = _start_long_run(tmp_path)
    try:
        parent.kill()  # SIGKILL: nothing runs in the parent; the kernel signals the children
        parent.wait(timeout=10)
        _gone, alive = psutil.wait_procs(family, timeout=60)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        _kill_all(parent, family)


def test_sigterm_stops_every_process_of_a_one_command_run_and_resume_finishes_it(
    tmp_path: Path,
) -> None:
    parent, run_dir, family = _start_long_run(tmp_path)
    try:
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=120) == 143, (tmp_path / "train.out").read_text()[-3000:]
        _gone, alive = psutil.wait_procs(family, timeout=10)
        assert alive == [], [p.cmdline() for p in alive]
        checkpoints = sorted((run_dir / "checkpoints" / "rl").glob("step_*"))
        assert checkpoints, "the learner did not checkpoint on SIGTERM"
    finally:
        _kill_all(parent, family)

    # --resume continues from the checkpoint with the queue Redis kept in its AOF.
    steps = int(checkpoints[-1].name[5:]) + 2
    resumed = _ludic(
        "train",
        str(DEMO),
        *_overrides(
            tmp_path, f"trainer.steps={steps}", "warm_start.steps=0", "pipeline.num_actors=2"
        ),
        "--resume",
        str(run_dir),
        out=tmp_path,
        name="resume",
    )
    assert resumed.wait(timeout=180) == 0, (tmp_path / "resume.out").read_text()[-3000:]
    assert [r["step"] for r in _records(run_dir, "rl")] == list(range(1, steps + 1))
    server = start_redis_server(run_dir / "redis")  # read what the run left in Redis
    try:
        q = _queue(server.url, prefix=run_dir.name)
        trained = q.records("trained")
        assert sorted(r["version"] for r in trained.values())[-2:] == [steps - 1, steps]
        finished = set(trained) | set(q.records("unused")) | set(q.records("dropped"))
        assert set(q.records("produced")) == finished  # nothing produced was lost
        assert q.queued() == 0 and q.client.llen(q.processing_key) == 0
    finally:
        server.stop()


def test_an_actor_without_a_learner_fails_with_a_timeout_error(
    redis_server, tmp_path: Path, capsys
) -> None:
    argv = ["actor", str(DEMO), *_overrides(tmp_path), "--run-dir", str(tmp_path / "none")]
    started = time.monotonic()
    assert cli.main([*argv, "pipeline.actor_timeout_s=0.5"]) == 2
    assert "no pipeline.json after 0.5s" in capsys.readouterr().err
    code = cli.main(
        [*argv, "pipeline.actor_timeout_s=0.5", f"pipeline.redis_url={redis_server.url}"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "error: no learner announced itself" in err and "within 0.5s" in err
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("command", ["learner", "actor"])
def test_learner_and_actor_need_pipeline_mode(tmp_path: Path, capsys, command: str) -> None:
    code = cli.main([command, str(DEMO), "--run-dir", str(tmp_path), "trainer.mode=async"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"trainer.mode='async': `ludic {command}` is one side of the actor/learner" in err


def test_pipeline_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config: pipeline is set but trainer.mode='sync'"):
        load_config(DEMO, ["pipeline.num_actors=2"])
    with pytest.raises(ConfigError, match=r"pipeline.num_actors: .* greater than or equal to 1"):
        load_config(DEMO, _overrides(tmp_path, "pipeline.num_actors=0"))
    with pytest.raises(ConfigError, match=r"pipeline.redis_url: not a Redis URL"):
        load_config(DEMO, _overrides(tmp_path, "pipeline.redis_url=localhost:6379"))
    with pytest.raises(
        ConfigError, match=r"trainer.max_staleness=0 is invalid; expected >= publish_every - 1 = 1"
    ):
        load_config(
            DEMO, _overrides(tmp_path, "trainer.max_staleness=0", "trainer.publish_every=2")
        )
    config = load_config(DEMO, _overrides(tmp_path))
    assert config.trainer.staleness == 1 and config.pipeline.redis_url is None


@pytest.mark.vllm
def test_one_command_pipeline_on_vllm_actors_generate_from_the_learners_server(
    redis_server, tmp_path: Path
) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    prefix = f"cli-vllm-{time.monotonic_ns()}"
    config = load_config(
        DEMO,
        _overrides(
            tmp_path,
            "inference.backend=vllm",
            "warm_start.steps=0",
            "trainer.steps=2",
            "eval.num_problems=2",
            f"pipeline.redis_url={redis_server.url}",
            f"pipeline.prefix={prefix}",
        ),
    )
    run_dir = jobs.train(config)
    rl = _records(run_dir, "rl")
    assert [r["step"] for r in rl] == [1, 2]
    assert all(0 <= r["staleness/max"] <= 1 for r in rl)  # versions from the server's header
    q = _queue(redis_server.url, prefix)
    assert sorted(r["version"] for r in q.records("trained").values()) == [1, 2]
    assert q.client.exists(q.keys.weights) == 0  # weights went to the vLLM server, not Redis
    assert "weights through vllm" in (run_dir / "logs" / "actor-0.log").read_text()
    assert (run_dir / "vllm_server.log").is_file()


def test_a_failing_child_fails_the_one_command_run_with_its_error(
    redis_server, tmp_path: Path
) -> None:
    from ludic.pipeline.launch import PipelineProcessError

    config = load_config(
        DEMO,
        _overrides(
            tmp_path,
            "warm_start.steps=0",
            "env.episode_timeout_s=0.000001",  # every episode (actor's or eval's) times out
            f"pipeline.redis_url={redis_server.url}",
            f"pipeline.prefix=cli-fail-{time.monotonic_ns()}",
        ),
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. a session server
    with pytest.raises(PipelineProcessError) as failure:
        jobs.train(config)
    message = str(failure.value)
    assert re.match(r"(learner|actor-0) exited with code 1: error: TimeoutError: ", message)
    assert "did not finish within timeout_s=1e-06" in message and "(log: " in message
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and "ludic" in _cmdline(p)
    ]
    assert left == []  # the other processes were stopped


def test_ludic_train_hands_the_reward_router_it_started_to_every_child(
    redis_server, tmp_path: Path, monkeypatch
) -> None:
    """With reward_loop.disrm, `ludic train` starts the reward servers and router once (a
    stand-in here; tests/vllm_reward/test_reward_loop_modes.py runs real ones) and hands
    the router to the learner and every actor in their environment, never on a command
    line; a child that fails stops the run, and the router with it."""
    from ludic.pipeline import launch

    events: list[str] = []

    @contextlib.contextmanager
    def router(config, *, log_dir):
        events.append("started")
        try:
            yield "http://127.0.0.1:9", "router-key-x"
        finally:
            events.append("stopped")

    # each child records its argv and environment, waits (SIGTERM ignored, 10 s at most)
    # until all three have, so the first to fail stops no other before it wrote; then fails
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\ntrap '' TERM INT\n"
        'echo "$@" > "$0.$$.argv"\nenv > "$0.$$.env.part" && mv "$0.$$.env.part" "$0.$$.env"\n'
        "i=0\n"
        'while [ "$(ls "$0".*.env | wc -l)" -lt 3 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done\n'
        "exit 1\n"
    )
    python.chmod(0o755)
    monkeypatch.setattr(launch, "reward_router", router)
    monkeypatch.setattr(launch.sys, "executable", str(python))
    config = load_config(
        DEMO,
        _overrides(
            tmp_path,
            "pipeline.num_actors=2",
            "reward_loop.disrm.num_servers=1",
            f"pipeline.redis_url={redis_server.url}",
            f"pipeline.prefix=cli-router-{time.monotonic_ns()}",
        ),
    )
    with pytest.raises(launch.PipelineProcessError, match="exited with code 1"):
        jobs.train(config)
    assert events == ["started", "stopped"]
    envs = [p.read_text().splitlines() for p in tmp_path.glob("python.*.env")]
    assert len(envs) == 3  # the learner and 2 actors
    for env in envs:
        assert "LUDIC_REWARD_ROUTER_URL=http://127.0.0.1:9" in env
        assert "LUDIC_REWARD_ROUTER_KEY=router-key-x" in env
    argvs = [p.read_text() for p in tmp_path.glob("python.*.argv")]
    assert len(argvs) == 3 and not any("router-key-x" in argv for argv in argvs)


def _cmdline(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline())
    return ""
