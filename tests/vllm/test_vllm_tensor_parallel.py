"""A run's exported policy (RUN_DIR/policy) on a tensor-parallel vLLM server (issue 27,
item 3: ``inference.vllm.tensor_parallel_size: 2``, on CPU two worker processes of one core
each, each holding half of every sharded layer). Served as it is, its greedy tokens and
logprobs equal transformers' on the same folder. A weight sync sends both workers the
full tensors and each loads its shard (the verification adds the shards' checksums up);
a load from disk (item 4) does the same; after each, the server equals a transformers
mirror again."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.faults.helpers import DEMO  # noqa: E402
from tests.run.test_job import _config  # noqa: E402
from tests.vllm.helpers import PROMPT, perturb, policy_server  # noqa: E402

from ludic import jobs  # noqa: E402
from ludic.run.export import POLICY_DIR, save_policy_folder  # noqa: E402
from ludic.run.loading import load_config  # noqa: E402
from ludic.run.servers import server_args  # noqa: E402


def test_an_exported_policy_on_two_workers_serves_syncs_and_loads_to_parity(tmp_path: Path):
    exported = jobs.train(_config(tmp_path / "runs")) / POLICY_DIR
    config = load_config(
        DEMO,
        [
            "inference.backend=vllm",
            "inference.vllm.tensor_parallel_size=2",
            "inference.vllm.cpu_cores=['0|1']",
        ],
    )
    v = config.inference.vllm
    args = [*server_args(v, cuda=False), "--weight-load-roots", str(tmp_path / "disk")]
    assert args[:2] == ["--tensor-parallel-size", "2"]
    with policy_server(
        tmp_path, extra_args=args, cpu_cores=v.cpu_cores[0], model_dir=exported
    ) as served:
        # the exported folder as served: 24 greedy tokens, as transformers runs it
        response = served.complete(PROMPT, sampling={"max_tokens": 24}, extra={"ignore_eos": True})
        completion = list(response.trace.completion_token_ids)
        greedy, reference = served.reference(PROMPT, completion)
        assert len(completion) == 24 and completion == greedy
        diffs = [abs(a - b) for a, b in zip(response.trace.completion_logprobs, reference)]
        assert max(diffs) <= served.logprob_tol

        assert served.client.control.world_size() == 2  # the sync group: 1 + 2 workers
        perturb(served.mirror, seed=27)
        served.client.sync_weights(served.mirror.state_dict(), version=1)
        served.assert_parity()
        report = served.client.control.weight_report()["workers"]
        assert sorted(w["tp_rank"] for w in report) == [0, 1] and report[0]["tp_size"] == 2
        assert any(entry["sharded"] for entry in report[0]["loaded"].values())

        perturb(served.mirror, seed=28)
        folder = save_policy_folder(served.mirror, served.tokenizer, tmp_path / "disk" / "policy")
        served.client.load_weights_from_disk(folder, version=2)
        served.assert_parity()
        assert served.client.get_policy_version() == 2
        report = served.client.control.weight_report()["workers"]  # read, loaded: sharded
        assert [w["version"] for w in report] == [2, 2] and report[1]["tp_rank"] == 1
        assert any(entry["sharded"] for entry in report[1]["loaded"].values())
