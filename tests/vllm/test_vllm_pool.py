"""Data-parallel inference against two real vLLM CPU servers (``VLLMClientPool``):
balancing, sticky sessions, one publish reaching both servers (a group each, or one group
spanning both) with parity against transformers, and a server killed with SIGKILL taken
out while nothing is lost, then restarted and brought back by the next publish.

The module's tests share two servers and run in file order: the last ones kill and
restart server B."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from tests.vllm.helpers import (  # noqa: E402
    API_KEY,
    FAULT_ENV,
    FAULT_WORKER,
    PROMPT,
    perturb,
    python_path,
)

from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec  # noqa: E402
from ludic.inference.vllm.joins import read_join_files  # noqa: E402
from ludic.inference.vllm.pool import NoServerAvailableError, VLLMClientPool  # noqa: E402

GREEDY = InferenceSpec(sampling=SamplingSpec(temperature=0.0, max_tokens=6))
DEMO = Path(__file__).parents[2] / "src" / "ludic" / "configs" / "arithmetic_demo.yaml"


class Pair:
    """Two servers on the same tiny model and the transformers mirror of their weights:
    A started as ``ludic train`` starts one, B with ``ludic serve policy --join RUN_DIR``
    (RUN_DIR a pool run on the same model), each pinned to a core of its own."""

    def __init__(self, root):
        from transformers import AutoModelForCausalLM

        from ludic.distributed.weight_transfer import free_port
        from ludic.inference.vllm.process import start_vllm_server
        from ludic.models.tiny import save_tiny_model

        self.root = root
        self.model_dir = save_tiny_model(root / "model")
        a = start_vllm_server(
            self.model_dir,
            api_key=API_KEY,
            log_path=root / "server0.log",
            wait=False,
            cpu_cores="0",  # one core each, as ludic train does
            extra_args=["--worker-extension-cls", FAULT_WORKER],  # off unless fault0
            env={FAULT_ENV: str(root / "fault0"), "PYTHONPATH": python_path()},
        )
        b = JoinedServer(self, port=free_port(), cpu_cores=str(1 % (os.cpu_count() or 1)))
        self.servers = [a, b]
        a.wait_until_healthy(300)
        b.wait_until_announced()
        self.mirror = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.mirror.eval()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def pool(self, **kwargs) -> VLLMClientPool:
        kwargs.setdefault("timeout_s", 60.0)
        return VLLMClientPool.connect(self.urls, api_key=API_KEY, **kwargs)

    def greedy(self, completion) -> list[int]:
        """The mirror's greedy next tokens along ``PROMPT + completion`` (teacher-forced)."""
        ids = torch.tensor([list(PROMPT) + list(completion)])
        with torch.no_grad():
            logits = self.mirror(ids).logits[0]
        return logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()

    def assert_mirrored(self, response) -> None:
        """The server's greedy completion is the mirror's."""
        completion = list(response.trace.completion_token_ids)
        assert completion == self.greedy(completion), response.meta["server"]

    def publish_to_both(self, pool: VLLMClientPool, version: int) -> list:
        """Publish the mirror; both servers take it and serve it (their greedy answers are
        the mirror's); returns their responses."""
        status = pool.sync_weights(self.mirror.state_dict(), version=version)
        assert f"2/2 server(s) as version {version}" in status
        responses = complete_all(pool, [CompletionRequest(PROMPT, GREEDY) for _ in range(4)])
        assert {r.meta["server"] for r in responses} == set(self.urls)
        for r in responses:
            self.assert_mirrored(r)
        return responses

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pair = Pair(tmp_path_factory.mktemp("pool"))
    try:
        yield pair
    finally:
        pair.stop()


class JoinedServer:
    """``ludic serve policy --join RUN_DIR --port P`` as a user starts it (the key in
    ``LUDIC_API_KEY``), RUN_DIR a pool run's config on the pair's model; with the tests'
    fault worker (``fault1``) and pinned to ``cpu_cores``. :meth:`wait_until_announced`
    returns once it serves and its join file is written."""

    def __init__(self, pair: Pair, port: int, cpu_cores: str) -> None:
        from ludic.inference.vllm.process import CPU_CORES_ENV
        from ludic.run.loading import dump_config, load_config

        self.run_dir = pair.root / "run"
        self.run_dir.mkdir(exist_ok=True)
        overrides = ["inference.backend=vllm", "inference.vllm.num_servers=2"]
        config = load_config(DEMO, [*overrides, f"model.path={pair.model_dir}"])
        (self.run_dir / "config.yaml").write_text(dump_config(config))
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = pair.root / f"server1-joined-{len(list(pair.root.glob('server1-*')))}.log"
        argv = ["serve", "policy", "--join", str(self.run_dir), "--port", str(port)]
        argv += ["--worker-extension-cls", FAULT_WORKER]
        env = {
            **os.environ,
            "LUDIC_API_KEY": API_KEY,
            FAULT_ENV: str(pair.root / "fault1"),
            "PYTHONPATH": python_path(),
            CPU_CORES_ENV: cpu_cores,
            "VLLM_CPU_OMP_THREADS_BIND": cpu_cores,
        }
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ludic", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.pid = self.process.pid

    def wait_until_announced(self) -> None:
        from ludic.inference.vllm.process import wait_for_vllm_health

        wait_for_vllm_health(self.url, 300, process=self.process, log_path=self.log)
        deadline = time.monotonic() + 30
        while self._announced_pid() != self.pid:
            assert time.monotonic() < deadline, "the joined server wrote no join file"
            time.sleep(0.2)

    def _announced_pid(self) -> int | None:
        name = read_join_files(self.run_dir / "servers").get(self.url)
        if name is None:
            return None
        return json.loads((self.run_dir / "servers" / name).read_text())["pid"]

    def log_tail(self, num_lines: int) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def complete_all(pool: VLLMClientPool, requests: list[CompletionRequest]):
    async def go():
        return await asyncio.gather(*(pool.complete(r) for r in requests))

    return asyncio.run(go())


def test_every_thread_of_a_pinned_server_runs_on_its_core(pair):
    import psutil

    for i, server in enumerate(pair.servers):
        core = i % (os.cpu_count() or 1)
        root = psutil.Process(server.pid)
        procs = [root, *root.children(recursive=True)]
        assert len(procs) >= 2  # ludic serve and vLLM's engine core at least
        for proc in procs:
            for thread in proc.threads():
                assert os.sched_getaffinity(thread.id) == {core}, (proc.cmdline(), thread.id)
        assert f"core ids=[{core}]" in server.log_tail(400)  # vLLM's OpenMP binding


def test_concurrent_requests_are_spread_evenly(pair):
    with pair.pool() as pool:
        responses = complete_all(pool, [CompletionRequest(PROMPT, GREEDY) for _ in range(8)])
        assert [s["served"] for s in pool.status()] == [4, 4]
        assert {r.meta["server"] for r in responses} == set(pair.urls)
        # the same weights on both servers: the same greedy completion
        assert len({r.trace.completion_token_ids for r in responses}) == 1


def test_a_session_stays_on_its_server(pair):
    with pair.pool() as pool:

        async def episode(session: str) -> set[str]:
            servers = set()
            for turn in range(4):
                request = CompletionRequest(PROMPT[: 3 + turn], GREEDY, session_id=session)
                servers.add((await pool.complete(request)).meta["server"])
            return servers

        async def go():
            return await asyncio.gather(*(episode(f"episode-{i}") for i in range(4)))

        per_episode = asyncio.run(go())
        assert all(len(s) == 1 for s in per_episode), per_episode
        assert {s for servers in per_episode for s in servers} == set(pair.urls)


def test_an_agent_episode_sticks_to_one_server_and_steps_name_it(pair):
    from ludic.agents.base_agent import Agent
    from ludic.context.full_dialog import FullDialog
    from ludic.inference.chat_template import HFChatTemplate
    from ludic.models.tiny import build_tiny_tokenizer
    from ludic.parsers import ParseResult

    with pair.pool() as pool:
        agent = Agent(
            client=pool,
            context=FullDialog(),
            parser=lambda text: ParseResult(action=text, reward=0.0),
            chat_template=HFChatTemplate(build_tiny_tokenizer()),
        )

        async def episode() -> list[str]:
            agent.on_env_reset("hi", {})
            servers = []
            for turn in range(3):
                act = await agent.act(inference=GREEDY, turn_id=f"t{turn}")
                servers.append(act.steps[-1].info["server"])
                agent.on_after_step(f"obs {turn}", {})
            return servers

        first = asyncio.run(episode())
        second = asyncio.run(episode())
        assert len(set(first)) == 1 and len(set(second)) == 1
        assert first[0] in pair.urls


@pytest.mark.parametrize("publish", ["per_server", "one_group"])
def test_one_publish_reaches_both_servers(pair, publish):
    with pair.pool(publish=publish) as pool:
        pool.init_weight_sync()
        version = 10 if publish == "per_server" else 11
        perturb(pair.mirror, seed=version)
        responses = pair.publish_to_both(pool, version=version)
        assert {r.trace.policy_version for r in responses} == {version}
        assert [s.client.get_policy_version() for s in pool.servers] == [version, version]
        assert pool.get_policy_version() == version


def test_a_publish_with_pause_keeps_versions_consistent(pair):
    with pair.pool(publish="one_group", partial_rollouts="continue") as pool:
        pool.init_weight_sync()
        perturb(pair.mirror, seed=12)
        status = pool.sync_weights(pair.mirror.state_dict(), version=12)
        assert "paused" in status
        assert [s["version"] for s in pool.status()] == [12, 12]
        assert not any(s.client.control.get("/is_paused")["is_paused"] for s in pool.servers)
        responses = complete_all(pool, [CompletionRequest(PROMPT, GREEDY) for _ in range(2)])
        assert {r.trace.policy_version for r in responses} == {12}


def test_a_rejected_update_fails_the_publish_and_takes_nothing_out(pair):
    with pair.pool() as pool:
        pool.init_weight_sync()
        before = [s.client.get_policy_version() for s in pool.servers]
        bad = {"model.no_such_layer.weight": torch.zeros(3)}
        with pytest.raises(Exception, match="no_such_layer"):
            pool.sync_weights(bad, version=99)
        assert all(s["live"] and not s["stale"] for s in pool.status())
        assert [s.client.get_policy_version() for s in pool.servers] == before


@pytest.mark.parametrize("publish", ["per_server", "one_group"])
def test_a_server_that_fails_verification_is_taken_out_until_a_verified_sync(pair, publish):
    """B's loader corrupts one value: the publish reaches A, and B (which still answers) is
    taken out rather than left serving other weights (one group spanning both: every
    server's report is checked, the failing one named). Once back, the next publish forms
    its group again, syncs and verifies it, and only then does it serve again."""
    version = 21 if publish == "per_server" else 24
    with pair.pool(publish=publish, timeout_s=30.0, probe_interval_s=0.2) as pool:
        pool.init_weight_sync()
        fault = pair.root / "fault1"
        fault.write_text("corrupt model.norm.weight")
        try:
            perturb(pair.mirror, seed=version)
            status = pool.sync_weights(pair.mirror.state_dict(), version=version)
        finally:
            fault.unlink()
        assert f"1/2 server(s) as version {version}" in status
        a, b = pool.status()
        assert a["live"] and not b["live"] and b["stale"]
        assert "SyncVerificationError" in b["last_error"] and "norm" in b["last_error"]
        for response in complete_all(pool, [CompletionRequest(PROMPT, GREEDY)] * 4):
            assert response.meta["server"] == pair.urls[0]
            pair.assert_mirrored(response)
        for _ in range(50):  # each request gives B's probe a chance; B answers again
            complete_all(pool, [CompletionRequest(PROMPT, GREEDY)])
            if pool.servers[1].live:
                break
            time.sleep(0.1)
        assert pool.status()[1]["live"] and pool.status()[1]["stale"]  # answers, not serving
        pair.publish_to_both(pool, version=version + 1)


def test_a_server_that_joins_serves_once_a_publish_synced_and_verified_it(pair):
    """A pool of A alone, as a run's: B (``ludic serve policy --join RUN_DIR``) announced
    itself in RUN_DIR/servers; it is added before the next publish, takes it (its group
    formed, the update verified) and only then serves. A file whose server never answers
    is left out without failing the publish."""
    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.inference.vllm.joins import write_join_file

    folder = pair.servers[1].run_dir / "servers"
    pool = VLLMClientPool.connect(pair.urls[:1], api_key=API_KEY, timeout_s=60.0)
    with pool:
        pool.accept_joins(folder, lambda url: VLLMChatClient(url, api_key=API_KEY, max_retries=0))
        pool.init_weight_sync()
        dead = write_join_file(folder, "http://127.0.0.1:9")  # nothing listens there
        before = complete_all(pool, [CompletionRequest(PROMPT, GREEDY)] * 4)
        assert {r.meta["server"] for r in before} == {pair.urls[0]}  # joins wait for a publish
        perturb(pair.mirror, seed=23)
        responses = pair.publish_to_both(pool, version=23)
        assert {r.trace.policy_version for r in responses} == {23}
        assert pool.base_urls == pair.urls
        assert [s.client.weight_sync.verified for s in pool.servers] == [1, 1]
    dead.unlink()


def test_no_server_left_raises_a_clear_error(pair):
    with pair.pool(timeout_s=5.0, max_retries=0) as pool:
        for server in pool.servers:
            pool._take_out(server, ConnectionError("test: taken out"))
        with pytest.raises(NoServerAvailableError, match="no vLLM server can take"):
            complete_all(pool, [CompletionRequest(PROMPT, GREEDY)])


def test_a_killed_server_is_taken_out_and_comes_back_after_a_restart(pair):
    """SIGKILL server B while requests run on both: every request is answered (B's by A)
    and B is taken out; the next publish reaches A alone. B then restarts on its port
    (``ludic serve policy --join RUN_DIR --port P``, the run's model) with the initial
    weights: it answers /health again but serves nothing until the next publish has
    formed its group again and sent it the pool's weights."""

    victim = pair.servers[1]
    pool = pair.pool(timeout_s=30.0, max_retries=0, probe_interval_s=0.2)
    with pool:
        pool.init_weight_sync()
        long = InferenceSpec(
            sampling=SamplingSpec(temperature=0.0, max_tokens=48), extra={"ignore_eos": True}
        )

        async def kill_under_load():
            tasks = [
                asyncio.ensure_future(pool.complete(CompletionRequest(PROMPT, long)))
                for _ in range(6)
            ]
            while pool.servers[1].in_flight < 3:
                await asyncio.sleep(0.01)
            os.killpg(victim.pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

        responses = asyncio.run(kill_under_load())
        assert len(responses) == 6
        assert all(len(r.trace.completion_token_ids) == 48 for r in responses), [
            (len(r.trace.completion_token_ids), r.finish_reason) for r in responses
        ]
        a, b = pool.status()
        # B's requests in flight at the kill were answered by A
        assert a["live"] and not b["live"] and b["stale"] and b["failures"] >= 1
        assert a["served"] >= 3 + b["failures"]

        perturb(pair.mirror, seed=13)
        status = pool.sync_weights(pair.mirror.state_dict(), version=13)
        assert "1/2 server(s) as version 13" in status and victim.url in status
        response = complete_all(pool, [CompletionRequest(PROMPT, GREEDY)])[0]
        assert response.meta["server"] == pair.urls[0]
        pair.assert_mirrored(response)

        victim.stop()
        # killed, it could not take its join file away: the restart writes its own
        assert victim.url in read_join_files(victim.run_dir / "servers")
        pair.servers[1] = joined = JoinedServer(pair, port=victim.port, cpu_cores="1")
        joined.wait_until_announced()

        async def until_probed() -> set[str]:
            servers = set()
            for _ in range(100):  # each request gives the probe a chance to start
                servers.add((await pool.complete(CompletionRequest(PROMPT, GREEDY))).meta["server"])
                if pool.servers[1].live:
                    break
                await asyncio.sleep(0.1)
            return servers

        assert asyncio.run(until_probed()) == {pair.urls[0]}
        a, b = pool.status()
        assert b["live"] and b["stale"]  # answers, but holds the initial weights
        assert {
            r.meta["server"] for r in complete_all(pool, [CompletionRequest(PROMPT, GREEDY)] * 4)
        } == {pair.urls[0]}

        responses = pair.publish_to_both(pool, version=14)
        assert {r.trace.policy_version for r in responses} == {14}


def test_a_server_dead_at_a_one_group_publish_is_left_out(pair):
    """One group spans both servers; B dies before a publish: the broken group is formed
    again over A alone and the update pushed once more. (Last test: B stays dead.)"""
    with pair.pool(publish="one_group", timeout_s=10.0, max_retries=0) as pool:
        pool.init_weight_sync()
        os.killpg(pair.servers[1].pid, signal.SIGKILL)
        pair.servers[1].process.wait(10)
        perturb(pair.mirror, seed=15)
        status = pool.sync_weights(pair.mirror.state_dict(), version=15)
        assert "1/2 server(s) as version 15" in status
        a, b = pool.status()
        assert a["version"] == 15 and not b["live"] and b["stale"]
        response = complete_all(pool, [CompletionRequest(PROMPT, GREEDY)])[0]
        pair.assert_mirrored(response)
        assert response.meta["server"] == pair.urls[0]
