"""Issue 14, Ray placement: ``ludic launch`` on a simulated two-node Ray cluster
(``ray.cluster_utils.Cluster``: two raylets on this machine, each its own Ray node).

* a policy server placed on the second node by Ray is synced by a trainer on the first
  to parity (greedy tokens and logprobs against a transformers mirror);
* a short real pipeline job end to end: the learner on the launching node, the vLLM
  server on the other; weights cross nodes every step; the rollout actor's Ray worker
  SIGKILLed mid-run is restarted by Ray, rejoins, and the run loses no step;
* a placement the cluster cannot grant fails within ``launch.placement_timeout_s``,
  naming what it asked for, and leaves nothing running;
* ``ludic launch`` without an address starts its own Ray on 127.0.0.1, and a SIGKILLed
  launcher leaves none of it running.

Every node of the cluster, and every server placed on it, is on 127.0.0.1 (the loopback
guard in ``tests/conftest.py`` fails a test whose processes listen anywhere else).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.faults.helpers import DEMO

from ludic.pipeline.ray_local import LOCAL_ONLY_ENV, LOOPBACK
from ludic.run.loading import load_config, validate_config

pytestmark = [pytest.mark.ray, pytest.mark.redis]

HEAD, NODE_B = "head_node", "node_b"


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ludic-rl[ray]')")
    from ray.cluster_utils import Cluster
    from tests.pipeline.helpers import require_redis_server

    require_redis_server()
    # two nodes on loopback (drivers joining at 127.0.0.1 need LOCAL_ONLY_ENV, which the
    # root conftest sets for every test)
    head = {"num_cpus": 2, "resources": {HEAD: 10}, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**head, "node_ip_address": LOOPBACK})
    cluster.add_node(num_cpus=2, resources={NODE_B: 10}, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


JOB = [
    "trainer.mode=pipeline",
    "trainer.max_staleness=1",
    "inference.backend=vllm",
    "warm_start.steps=0",
    "trainer.steps=6",
    "trainer.prompts_per_step=2",
    "algorithm.group_size=2",
    "eval.num_problems=2",
    "logging.console_every=1",
    "logging.num_sample_rollouts=1",
    "env.kwargs.num_problems=8",
    "pipeline.num_actors=1",
    "pipeline.stop_timeout_s=30",
    # the learner on the head, the server on node B
    f"launch.learner.resources={{{HEAD}: 1}}",
    "launch.learner.cpus=0.5",
    f"launch.policy_server.resources={{{NODE_B}: 1}}",
    "launch.policy_server.cpus=0.5",
    "launch.rollout_actor.cpus=0.5",
    "launch.strategy=STRICT_SPREAD",
]


class Launched:
    """``python -m ludic launch`` in a subprocess; its output collected line by line."""

    def __init__(self, cwd: Path, *argv: str, env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ludic", "launch", *argv],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, pattern: str, timeout_s: float, occurrence: int = 1) -> re.Match[str]:
        """The ``occurrence``-th output line matching ``pattern``."""
        deadline = time.monotonic() + timeout_s
        while True:
            exited = self.proc.poll() is not None
            if exited:
                time.sleep(0.5)  # the reader's last lines
            matches = [m for line in list(self.lines) if (m := re.search(pattern, line))]
            if len(matches) >= occurrence:
                return matches[occurrence - 1]
            if exited or time.monotonic() >= deadline:
                raise AssertionError(f"no line matching {pattern!r}:\n{self.output()[-6000:]}")
            time.sleep(0.2)

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _placed(out: str, name: str) -> dict[str, str]:
    match = re.search(
        rf"^{name}: pid (\d+) on node \S+ \((\w+)\), Ray actor pid (\d+)", out, re.MULTILINE
    )
    assert match, f"{name} was not placed:\n{out[-4000:]}"
    return {"pid": match[1], "node": match[2], "actor_pid": match[3]}


@pytest.mark.vllm
def test_a_job_runs_across_two_nodes_and_survives_a_killed_rollout_actor(
    cluster, tmp_path: Path
) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    # 16 steps: admission control lets the actor run at most max_staleness batches ahead,
    # but the launcher's output lags the learner by a few steps; with the 6 steps of JOB the
    # learner was seen finishing on batches made before the kill (about 1 run in 3)
    launched = Launched(
        tmp_path,
        str(DEMO),
        "--address",
        cluster.address,
        f"output_dir={tmp_path}",
        *JOB,
        "trainer.steps=16",
    )
    joined = r"^\[actor-0\] actor actor-0: Redis .* \(weights through vllm\)"
    try:
        launched.wait_for_line(r"^\[learner\] step 2 ", timeout_s=600)
        out = launched.output()
        learner, server = _placed(out, "learner"), _placed(out, "policy-server-0")
        assert learner["node"] != server["node"]  # every publish crosses nodes
        # the only rollout actor's Ray worker, as a crash: no step without its restart
        os.kill(int(_placed(out, "actor-0")["actor_pid"]), signal.SIGKILL)
        launched.wait_for_line(r"^\[actor-0\] restarted by Ray \(1 of 3\)", timeout_s=300)
        launched.wait_for_line(joined, timeout_s=300, occurrence=2)  # back in the run
        assert launched.proc.wait(timeout=600) == 0, launched.output()[-6000:]
    finally:
        launched.stop()
    out = launched.output()
    run_dir = Path(re.findall(r"^run directory: (\S+)", out, re.MULTILINE)[-1])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(1, 17))  # no step lost to the kill
    saved = load_config(run_dir / "config.yaml").inference.vllm  # the run's own placement,
    assert saved.start_server and saved.urls == [] and saved.group_host is None  # not the URLs
    assert all(0 <= r["staleness/max"] <= 1 for r in rl)  # versions from node B's server
    for name in ("learner", "policy-server-0", "actor-0"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    assert "Redis redis://:***@" in out  # the password never printed
    assert not _leftover_ludic_processes(tmp_path)


def test_a_sharded_learner_spans_both_nodes_and_a_killed_rank_or_sigterm_stops_the_run(
    cluster, tmp_path: Path
) -> None:
    """Transformers inference (a learner and an actor, no server), three launches of one
    run: (1) a two-rank learner, one rank on each node (``launch.learner_strategy:
    STRICT_SPREAD``): its rank 1 SIGKILLed mid-run stops every placed process (exit 1,
    naming the failure); (2) ``--resume`` with one rank continues from the last sharded
    checkpoint, and SIGTERM to ``ludic launch`` mid-run exits 143 with the last step
    checkpointed; (3) ``--resume`` finishes the run: every step logged once, in order. No
    process outlives a launch."""
    from tests.faults.helpers import checkpoint_steps, steps

    job = [
        *JOB,
        "inference.backend=transformers",
        "trainer.steps=40",
        "trainer.checkpoint_every=2",
        "eval.every=0",
    ]
    argv = [str(DEMO), "--address", cluster.address, f"output_dir={tmp_path}", *job]
    spread = ["launch.learner.resources={}", "launch.learner_strategy=STRICT_SPREAD"]
    launched = Launched(tmp_path, *argv, "trainer.world_size=2", *spread)
    try:
        launched.wait_for_line(r"^\[learner\] step 3 ", timeout_s=300)
        out = launched.output()
        ranks = [_placed(out, "learner"), _placed(out, "learner-rank-1")]
        os.kill(int(ranks[1]["pid"]), signal.SIGKILL)
        code = launched.proc.wait(timeout=180)
    finally:
        launched.stop()
    out = launched.output()
    assert code == 1, out[-4000:]
    assert ranks[0]["node"] != ranks[1]["node"]  # the group spans both nodes
    assert re.search(r"^error: .*learner(-rank-1)? exited with code", out, re.MULTILINE), out[
        -3000:
    ]
    run_dir = Path(re.findall(r"^run directory: (\S+)", out, re.MULTILINE)[0])
    sharded = checkpoint_steps(run_dir, "rl")
    assert sharded and (run_dir / "checkpoints" / "rl" / f"step_{sharded[-1]:08d}" / "dcp").is_dir()
    assert not _leftover_ludic_processes(tmp_path)

    resumed = [*argv, "--resume", str(run_dir)]  # one rank, on the head
    launched = Launched(tmp_path, *resumed)
    try:
        launched.wait_for_line(rf"^\[learner\] step {sharded[-1] + 2} ", timeout_s=300)
        os.kill(launched.proc.pid, signal.SIGTERM)
        code = launched.proc.wait(timeout=180)
    finally:
        launched.stop()
    out = launched.output()
    assert code == 143, out[-4000:]
    assert re.search(r"interrupted; continue .*ludic launch .*--resume", out), out[-2000:]
    done = steps(run_dir, "rl")
    assert done == list(range(1, len(done) + 1)) and len(done) >= sharded[-1] + 2
    assert checkpoint_steps(run_dir, "rl")[-1] == done[-1]
    assert not _leftover_ludic_processes(tmp_path)

    finished = Launched(tmp_path, *resumed, f"trainer.steps={done[-1] + 2}")
    try:
        assert finished.proc.wait(timeout=300) == 0, finished.output()[-4000:]
    finally:
        finished.stop()
    assert steps(run_dir, "rl") == list(range(1, done[-1] + 3))
    assert not _leftover_ludic_processes(tmp_path)


def test_a_placement_the_cluster_cannot_grant_fails_naming_it(cluster, tmp_path: Path) -> None:
    launched = Launched(
        tmp_path,
        str(DEMO),
        "--address",
        cluster.address,
        f"output_dir={tmp_path}",
        *JOB,
        "launch.policy_server.resources={gpu_node: 1}",
        "launch.placement_timeout_s=3",
    )
    try:
        code = launched.proc.wait(timeout=180)
    finally:
        launched.stop()
    out = launched.output()
    assert code == 2, out[-4000:]
    assert "error: launch: Ray could not place the servers" in out
    assert "'gpu_node': 1.0" in out and "launch.placement_timeout_s" in out
    assert not _leftover_ludic_processes(tmp_path)


@pytest.mark.vllm
def test_a_server_on_another_node_is_synced_to_parity(cluster, tmp_path: Path) -> None:
    """The launcher's own placement: a policy server in a Ray actor on node B; this
    process (a driver on the head) forms the weight-sync group over the node's address."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from tests.vllm.helpers import API_KEY, ServedPolicy
    from transformers import AutoModelForCausalLM

    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.inference.vllm.process import wait_for_vllm_health
    from ludic.models.tiny import build_tiny_tokenizer
    from ludic.pipeline.ray_processes import PlacedProcess, ProcessSpec
    from ludic.run.loading import dump_config
    from ludic.run.models import policy_folder

    config = load_config(DEMO, [f"output_dir={tmp_path}", *JOB])
    ray.init(address=cluster.address, log_to_driver=False)
    node_b = next(n["NodeID"] for n in ray.nodes() if NODE_B in n["Resources"])
    ip = ray.util.get_node_ip_address()
    spec = ProcessSpec(
        "policy-server-0",
        "policy_server",
        config_yaml=dump_config(config),
        run_name="parity",
        overrides=("--weight-sync-hosts", ip),
        env={"LUDIC_API_KEY": API_KEY},
    )
    server = (
        ray.remote(PlacedProcess)
        .options(
            num_cpus=0.5,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_b, soft=False),
        )
        .remote(spec)
    )
    client = None
    try:
        info = ray.get(server.poll.remote(), timeout=120)
        assert info["node_id"] == node_b != ray.get_runtime_context().get_node_id()
        wait_for_vllm_health(info["url"], 600, server_type="policy")
        client = VLLMChatClient(info["url"], api_key=API_KEY, timeout_s=60.0)
        client.init_weight_sync(master_addr=ip)  # the head's address, not loopback
        model_dir = Path(policy_folder(config, tmp_path / "model"))
        mirror = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        served = ServedPolicy(None, client, mirror, build_tiny_tokenizer(), model_dir)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in mirror.parameters():
                p.add_(0.05 * torch.randn_like(p))
        client.sync_weights(
            {k: v.detach().clone() for k, v in mirror.state_dict().items()}, version=1
        )
        assert client.get_policy_version() == 1
        served.assert_parity()
    finally:
        if client is not None:
            client.close()
        ray.get(server.stop.remote(30.0), timeout=60)
        ray.kill(server)
        ray.shutdown()


def test_a_local_launch_runs_on_loopback_and_a_sigkilled_launcher_leaves_no_ray_process(
    tmp_path: Path,
) -> None:
    """No ``--address``: the launcher starts Ray itself, on 127.0.0.1 without being told
    (``LOCAL_ONLY_ENV`` left out of its environment), and a SIGKILL to the launcher alone
    ends all of it: Ray's processes (in the launcher's session), the run's (marked).
    ``--resume`` then trains every batch index of an uninterrupted run exactly once: those
    trained after the last checkpoint are trained again from it, once, the one the killed
    actor had claimed is made by its restart, and the token ledger closes."""
    import psutil
    from tests.faults.helpers import records

    mark = f"loopback-{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_ONLY_ENV}
    env["LUDIC_TEST_MARK"] = mark
    job = [*JOB, "inference.backend=transformers", "trainer.steps=40", "eval.every=0"]
    job = [j for j in job if "resources=" not in j and "strategy" not in j]
    job += ["pipeline.stop_timeout_s=5", "trainer.checkpoint_every=2"]
    argv = [str(DEMO), f"output_dir={tmp_path}", *job]
    launched = Launched(tmp_path, *argv, env=env)
    try:
        launched.wait_for_line(r"^\[learner\] step 3 ", timeout_s=300)  # after checkpoint 2
        out = launched.output()
        assert f"redis-server: {LOOPBACK}:" in out, out[-4000:]
        for name in ("learner", "actor-0"):
            assert re.search(rf"^{name}: pid \d+ on node {LOOPBACK} ", out, re.MULTILINE), out
        os.kill(launched.proc.pid, signal.SIGKILL)  # the launcher only, not its group
        launched.proc.wait(timeout=30)
        left = _leftover(launched.proc.pid, mark, psutil)
    finally:
        launched.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launched.proc.pid, signal.SIGKILL)  # what a failed check left
    assert not left, left

    run_dir = Path(re.findall(r"^run directory: (\S+)", launched.output(), re.MULTILINE)[0])
    killed_at = max(r["step"] for r in records(run_dir, "rl"))  # the output lags: >= 3
    total = killed_at + 3
    resumed = Launched(tmp_path, *argv, f"trainer.steps={total}", "--resume", str(run_dir), env=env)
    try:
        assert resumed.proc.wait(timeout=300) == 0, resumed.output()[-4000:]
    finally:
        resumed.stop()
    rl = records(run_dir, "rl")
    assert [r["step"] for r in rl] == list(range(1, total + 1)), killed_at
    # one actor, max_staleness 1: an uninterrupted run trains batch indices 0..total-1 (its
    # prompts are a function of the index); none skipped, none twice
    indices = [r["batch/pipeline_batch_index"] for r in rl]
    assert sorted(indices) == list(range(total)), (indices, killed_at)
    ledger = json.loads((run_dir / "summary.json").read_text())["token_ledger"]
    assert ledger["generated"] == sum(v for k, v in ledger.items() if k != "generated"), ledger
    assert ledger["in_flight"] == 0 and ledger["trained"] > 0, ledger


def _leftover(session: int, mark: str, psutil, timeout_s: float = 20.0) -> list[str]:
    """Processes still running after ``timeout_s`` in ``session`` or with ``mark`` in their
    environment."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for proc in psutil.process_iter(["name", "status"]):
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            with contextlib.suppress(psutil.Error):
                if os.getsid(proc.pid) == session or proc.environ().get("LUDIC_TEST_MARK") == mark:
                    left.append(f"{proc.pid} {proc.info['name']}")
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def test_launch_config_errors_name_the_field(tmp_path: Path) -> None:
    from ludic.pipeline.ray_launch import check_placement
    from ludic.run.errors import RunError
    from ludic.run.loading import ConfigError

    base = [f"output_dir={tmp_path}", *JOB]
    with pytest.raises(ConfigError, match=r"launch.rollout_actor.cpus: .* greater than 0"):
        load_config(DEMO, [*base, "launch.rollout_actor.cpus=0"])
    with pytest.raises(ConfigError, match=r"launch.strategy"):
        load_config(DEMO, [*base, "launch.strategy=EVERYWHERE"])
    with pytest.raises(RunError, match=r"Ray Client is not supported"):
        check_placement(load_config(DEMO, [*base, "launch.address=ray://head:10001"]))
    with pytest.raises(RunError, match=r"Ray address 'ray://h:1': Ray Client"):
        check_placement(load_config(DEMO, base), "ray://h:1")  # --address
    cuda = load_config(DEMO, [*base, "model.device=cuda"])
    with pytest.raises(RunError, match=r"launch.learner.gpus=0 with model.device=cuda"):
        check_placement(cuda)
    data = cuda.model_dump()
    data["launch"]["learner"]["gpus"] = 1
    with pytest.raises(RunError, match=r"launch.policy_server.gpus=0"):
        check_placement(validate_config(data))
    data["launch"]["policy_server"]["gpus"] = 1
    data["inference"]["vllm"]["tensor_parallel_size"] = 2
    with pytest.raises(
        RunError, match=r"launch.policy_server.gpus=1 with .*tensor_parallel_size=2"
    ):
        check_placement(validate_config(data))
    ipc = load_config(DEMO, [*base, "model.device=cuda", "inference.vllm.sync_strategy=cuda_ipc"])
    with pytest.raises(RunError, match=r"places the servers apart from the learner"):
        check_placement(ipc)


def test_the_learner_ranks_meet_on_the_launching_node_and_need_the_run_directory(
    tmp_path: Path,
) -> None:
    from ludic.pipeline.ray_launch import _learner_ranks
    from ludic.pipeline.ray_processes import PlacedProcess

    config = load_config(DEMO, [f"output_dir={tmp_path}", *JOB, "trainer.world_size=3"])
    common = dict(config_yaml="{}", run_name="run", env={"LUDIC_API_KEY": "k"}, cwd=None)
    members = _learner_ranks(config, tmp_path, "127.0.0.1", ("a=1",), common)
    assert [spec.name for spec, _ in members] == ["learner", "learner-rank-1", "learner-rank-2"]
    envs = [spec.env for spec, _ in members]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert envs[0]["MASTER_ADDR"] == "127.0.0.1" and envs[0]["LUDIC_API_KEY"] == "k"
    assert "node:127.0.0.1" in members[0][1].resources  # rank 0 owns the run directory
    assert all("node:127.0.0.1" not in place.resources for _, place in members[1:])
    assert {HEAD} <= set(members[2][1].resources)  # every rank reserves launch.learner
    one = _learner_ranks(config.model_copy(update={"trainer": config.trainer.model_copy(
        update={"world_size": 1})}), tmp_path, "127.0.0.1", (), common)  # fmt: skip
    assert len(one) == 1 and "RANK" not in one[0][0].env  # one process, as before

    far = object.__new__(PlacedProcess)  # rank 2 on a node without the run directory
    far.spec = dataclasses.replace(members[2][0], run_dir="/nowhere")
    far.node_ip = "10.0.0.9"
    with pytest.raises(FileNotFoundError, match=r"learner-rank-2 on node 10.0.0.9: .*shared"):
        far._command()


def test_a_loopback_ray_address_is_recognised() -> None:
    from ludic.pipeline.ray_local import is_loopback_address

    for address in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379", "127.0.1.1:1"):
        assert is_loopback_address(address)
    for address in ("10.0.0.2:6379", "head:6379", "[2001:db8::1]:6379"):
        assert not is_loopback_address(address)


def test_the_servers_placement_reaches_the_learner_and_actors_as_resumable_overrides(
    tmp_path: Path,
) -> None:
    from ludic.pipeline.ray_launch import _server_overrides
    from ludic.pipeline.run_info import PIPELINE_RESUMABLE
    from ludic.run.run_dir import _flat_diff

    two = [f"output_dir={tmp_path}", *JOB, "inference.vllm.num_servers=2"]
    two.append("inference.vllm.cpu_cores=[0, 1]")  # one set per placed server
    config = load_config(DEMO, two)
    urls = {"policy-server-1": "http://10.0.0.2:8001", "policy-server-0": "http://10.0.0.3:8000"}
    urls["reward-server"] = "http://10.0.0.4:9000"
    overrides = _server_overrides(config, urls, "10.0.0.1")
    learner = load_config(DEMO, [*two, *overrides["learner"]])  # a valid config
    v = learner.inference.vllm
    assert v.urls == ["http://10.0.0.3:8000", "http://10.0.0.2:8001"] and not v.start_server
    assert v.group_host == "10.0.0.1" and v.cpu_cores == []
    assert overrides["actor"] == [
        "reward.server.start_server=false",
        "reward.server.host=10.0.0.4",
        "reward.server.port=9000",
    ]
    changed = _flat_diff(config.model_dump(), learner.model_dump())
    assert changed and all(
        any(key == r or key.startswith(r + ".") for r in PIPELINE_RESUMABLE) for key in changed
    )


def _leftover_ludic_processes(tmp_path: Path, timeout_s: float = 20.0) -> list[str]:
    """``ludic`` processes of this test's runs still running after ``timeout_s`` (none may
    outlive a launch)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.info["status"] == psutil.STATUS_ZOMBIE or "-m ludic" not in cmd:
                continue
            if str(tmp_path) in cmd or "ludic-launch" in cmd:
                left.append(cmd)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)
