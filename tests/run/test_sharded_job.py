"""``ludic train`` with ``trainer.world_size: 2``: two FSDP2 trainer processes (gloo on
CPU) started by the CLI under torchrun. The run is the one a single process makes (same
warm-start losses and gradient norms), checkpoints through torch.distributed.checkpoint
(each checkpoint with its policy folder, gathered), writes a loadable policy folder, and
resumes in a single process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.faults.helpers import DEMO, TINY


def ludic_train(out: Path, *overrides: str, resume: Path | None = None) -> tuple[Path, str]:
    command = [sys.executable, "-m", "ludic", "train", str(DEMO), f"output_dir={out}"]
    command += [*TINY, *overrides] + (["--resume", str(resume)] if resume else [])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dirs = [
        line.split(": ", 1)[1]
        for line in done.stdout.splitlines()
        if line.startswith("run directory: ")
    ]
    return Path(run_dirs[-1]), done.stdout


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    run, _ = ludic_train(tmp_path_factory.mktemp("two"), "trainer.world_size=2")
    return run


def test_two_trainer_ranks_make_the_single_process_run(sharded_run, tmp_path) -> None:
    single, _ = ludic_train(tmp_path)
    two, one = metrics(sharded_run), metrics(single)
    assert [(r["phase"], r["step"]) for r in two] == [(r["phase"], r["step"]) for r in one]
    for a, b in zip(two, one, strict=True):
        if a["phase"] == "warm_start":  # the same batches, so the same numbers
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    rl = [r for r in two if r["phase"] == "rl"]
    assert [r["policy_version"] for r in rl] == [1, 2, 3, 4]


def test_checkpoints_are_sharded_and_the_policy_folder_loads(sharded_run) -> None:
    from transformers import AutoModelForCausalLM

    last = sharded_run / "checkpoints" / "rl" / "step_00000004"
    assert (last / "dcp" / ".metadata").is_file() and not (last / "model.pt").exists()
    policy = AutoModelForCausalLM.from_pretrained(sharded_run / "policy")
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    # the last checkpoint's policy folder (gathered from both ranks) holds the final weights
    checkpointed = AutoModelForCausalLM.from_pretrained(last / "policy").state_dict()
    for name, weight in policy.state_dict().items():
        assert torch.equal(checkpointed[name], weight), name
    assert (last / "policy" / "ludic_checksums.json").is_file()


def test_a_sharded_run_resumes_in_one_process(sharded_run) -> None:
    run, _ = ludic_train(
        sharded_run.parent, "trainer.world_size=1", "trainer.steps=6", resume=sharded_run
    )
    assert run == sharded_run
    rl = [r for r in metrics(run) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / "rl" / "step_00000006" / "model.pt").is_file()
