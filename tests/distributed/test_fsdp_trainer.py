"""Data-parallel training with FSDP2 on CPU (gloo): two trainer processes give the same
losses, gradient norms and updated weights as one process (float64 to 1e-10, float32 to
1e-5), whatever the loss, micro-batching and mini-batching; a failing batch source on
rank 0 stops every rank with a clear error instead of a hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("fsdp_worker.py")
ROOT = WORKER.parents[2]

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def run(out: Path, *args: str, world_size: int = 0) -> subprocess.CompletedProcess[str]:
    return run_argv([str(out), *args], world_size=world_size)


def run_argv(argv: list[str], world_size: int = 0) -> subprocess.CompletedProcess[str]:
    """The worker with ``argv`` (``OUT ARGS``, or several runs: ``OUT1 ARGS1 + OUT2 ...``);
    ``world_size`` 0: one process without ranks, else under torchrun (1: a group of one,
    sharded all the same)."""
    if world_size == 0:
        command = [sys.executable, str(WORKER), *argv]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={world_size}", str(WORKER), *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def train(out: Path, *args: str, world_size: int = 0) -> dict:
    done = run(out, *args, world_size=world_size)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out / "result.pt", weights_only=True)


EXACT = {
    # several micro-batches per rank, ranks running padding micro-batches
    "grpo-microbatches": (["grpo", "float64", "--budget", "48"], 1e-10),
    # GRPO groups share prompts: sharded ranks run plain forwards (a shared-prefix one runs
    # the decoder twice; every rank must run as many as the others), compared with a single
    # process told to do the same
    "grpo-groups": (["grpo", "float64", "--groups", "--batch", "8"], 1e-10),
    # two updates per step: proximal logprobs sharded, batch-mean preprocess
    "decoupled-minibatches": (["decoupled_ppo", "float64", "--minibatches", "2"], 1e-10),
    # sequence-level ratios; the whole-vocabulary logits path. In float32 Adam turns
    # rounding noise in near-zero gradients (k_proj's bias: softmax ignores it) into
    # updates of up to lr; eps 1e-3 keeps those at the gradients' own precision.
    "gspo-float32": (
        ["gspo", "float32", "--logprobs", "full", "--budget", "1000", "--adam-eps", "1e-3"],
        1e-5,
    ),
    "gspo-float64": (["gspo", "float64", "--logprobs", "full", "--budget", "1000"], 1e-10),
    # one item: rank 1 has nothing of its own and runs padding only
    "one-item": (["sft", "float64", "--batch", "1"], 1e-10),
    # a pipeline learner: rank 0 takes the batches from a Redis queue (wire format) and
    # acknowledges each after its step (one process: the same, without ranks)
    "pipeline-queue": (["grpo", "float64", "--budget", "48", "--redis", "{redis}"], 1e-10),
}


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory: pytest.TempPathFactory, redis_server) -> Path:
    """Every case of :data:`EXACT` trained by one process and by two ranks: one process
    (and one torchrun) for all of them, one case after another (the start-ups are most of
    the time)."""
    root = tmp_path_factory.mktemp("fsdp_exact")
    one: list[str] = []
    two: list[str] = []
    for name, (template, _) in EXACT.items():
        args = [arg.format(redis=redis_server.url) for arg in template]
        same = ["--no-shared-prefix"] if "--groups" in args else []
        one += ["+", str(root / "one" / name), *args, *same]
        two += ["+", str(root / "two" / name), *args]
    for argv, world_size in ((one[1:], 0), (two[1:], 2)):
        done = run_argv(argv, world_size=world_size)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


@pytest.mark.parametrize("case", list(EXACT))
def test_two_ranks_train_exactly_as_one_process(exact_runs: Path, case: str):
    args, tol = EXACT[case]
    one = torch.load(exact_runs / "one" / case / "result.pt", weights_only=True)
    two = torch.load(exact_runs / "two" / case / "result.pt", weights_only=True)
    assert len(one["history"]) == len(two["history"]) == 2
    for step_one, step_two in zip(one["history"], two["history"], strict=True):
        assert set(step_one) == set(step_two)
        keys = ["loss", "grad_norm", "entropy", "num_action_tokens"]
        keys += [] if "--groups" in args else ["num_tokens_run"]  # shared prefixes run fewer
        for key in keys:
            assert step_two[key] == pytest.approx(step_one[key], rel=tol, abs=tol), key
        # (loss/* stats are averaged over micro-batches by action-token share, which is
        # exact only for token-level stats: they are not compared.)
    assert one["weights"].keys() == two["weights"].keys()
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=tol, atol=tol, msg=name)
    assert all(step["grad_norm"] > 1e-3 for step in one["history"])  # the weights moved
    queued = ["batch-0", "batch-1"] if "--redis" in args else []
    assert one["trained"] == two["trained"] == queued  # each acknowledged, by rank 0 ...
    assert one["acks"] == two["acks"] == len(queued)  # ... once


def test_data_exhausted_on_rank_zero_ends_every_rank_cleanly(tmp_path: Path) -> None:
    result = train(tmp_path, "grpo", "float64", "--steps", "3", "--batches", "1", world_size=2)
    assert len(result["history"]) == 1


def test_a_failing_source_on_rank_zero_stops_every_rank_with_its_error(tmp_path: Path) -> None:
    done = run(
        tmp_path, "grpo", "float64", "--steps", "3", "--batches", "1", "--fail", world_size=2
    )
    assert done.returncode != 0
    assert "RuntimeError: the rollout engine broke" in done.stderr
    assert "rank 0 stopped the step: RuntimeError: the rollout engine broke" in done.stderr


@pytest.mark.parametrize(
    ("first", "then"),
    [(2, 1), (0, 2)],  # a group of one shards too (FSDP2 over one rank)
    ids=["2-ranks-to-a-group-of-1", "1-process-to-2-ranks"],
)
def test_a_checkpoint_resumes_at_another_world_size(tmp_path: Path, first: int, then: int):
    # Steps 1-2 at one world size (checkpointed every step), step 3 at the other after a
    # resume: the same weights as three uninterrupted steps in one process.
    args = ["decoupled_ppo", "float64", "--minibatches", "2", "--budget", "48"]
    whole = train(tmp_path / "whole", *args, "--steps", "3")
    checkpoints = str(tmp_path / "checkpoints")
    part = train(
        tmp_path / "part", *args, "--steps", "2", "--checkpoints", checkpoints, world_size=first
    )
    rest = train(
        tmp_path / "rest", *args, "--steps", "3", "--checkpoints", checkpoints, "--resume",
        world_size=then,
    )  # fmt: skip
    assert len(part["history"]) == 2 and len(rest["history"]) == 1
    assert rest["history"][0]["loss"] == pytest.approx(whole["history"][2]["loss"], abs=1e-10)
    sharded = (tmp_path / "checkpoints" / "step_00000002" / "dcp").is_dir()
    assert sharded == (first > 0)  # a sharded run saves through torch.distributed.checkpoint
    for name, weight in whole["weights"].items():
        torch.testing.assert_close(rest["weights"][name], weight, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP2 over NCCL needs a CUDA GPU")
def test_a_group_of_one_gpu_trains_and_resumes_as_one_process(tmp_path: Path) -> None:
    """A group of one on one GPU (torchrun, NCCL default group): the policy sharded by
    FSDP2 over that rank, checkpointed through torch.distributed.checkpoint and resumed,
    trains as a plain process does (the sharded learner's path on the smallest machine;
    on CPU, ``test_a_checkpoint_resumes_at_another_world_size`` runs a group of one)."""
    args = ["grpo", "float32", "--device", "cuda", "--adam-eps", "1e-3", "--budget", "48"]
    whole = train(tmp_path / "whole", *args, "--steps", "3")
    checkpoints = str(tmp_path / "checkpoints")
    train(tmp_path / "part", *args, "--steps", "2", "--checkpoints", checkpoints, world_size=1)
    assert (tmp_path / "checkpoints" / "step_00000002" / "dcp").is_dir()  # sharded
    rest = train(
        tmp_path / "rest", *args, "--steps", "3", "--checkpoints", checkpoints, "--resume",
        world_size=1,
    )  # fmt: skip
    assert rest["history"][0]["loss"] == pytest.approx(whole["history"][2]["loss"], abs=1e-4)
    for name, weight in whole["weights"].items():
        torch.testing.assert_close(rest["weights"][name], weight, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="FSDP2 over NCCL needs two CUDA GPUs (one per rank)",
)
def test_two_gpu_ranks_train_as_one_gpu(tmp_path: Path) -> None:
    args = ["grpo", "float32", "--device", "cuda", "--adam-eps", "1e-3", "--budget", "48"]
    one = train(tmp_path / "one", *args, *(["--no-shared-prefix"] if "--groups" in args else []))
    two = train(tmp_path / "two", *args, world_size=2)
    for step_one, step_two in zip(one["history"], two["history"], strict=True):
        assert step_two["loss"] == pytest.approx(step_one["loss"], rel=1e-4, abs=1e-5)
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=1e-4, atol=1e-4, msg=name)
