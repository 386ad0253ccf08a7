"""Issue 27, item 3: a tensor-parallel policy server (``inference.vllm.tensor_parallel_size:
2``) on CPU: two vLLM worker processes (one core each), each holding half of every
sharded layer. A weight sync sends both the full tensors; each loads its shard, and the
verification adds the shards' checksums up. Greedy tokens and logprobs then equal a
transformers mirror's; so they do after a load from disk (item 4) on the same server."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.faults.helpers import DEMO  # noqa: E402
from tests.vllm.helpers import perturb, policy_server  # noqa: E402

from ludic.run.export import save_policy_folder  # noqa: E402
from ludic.run.loading import load_config  # noqa: E402
from ludic.run.servers import server_args  # noqa: E402


def test_a_two_worker_server_takes_syncs_and_disk_loads_to_parity(tmp_path: Path) -> None:
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
    with policy_server(tmp_path, extra_args=args, cpu_cores=v.cpu_cores[0]) as served:
        assert served.client.control.world_size() == 2  # the sync group: trainer + 2 workers
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
