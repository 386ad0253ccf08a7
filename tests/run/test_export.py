"""The trained policy as a Hugging Face folder: RUN_DIR/policy after a run, and
``ludic export`` of any kept checkpoint, loaded back with ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.run.test_job import _config

from ludic import jobs
from ludic.cli import EXIT_OK, EXIT_USAGE, main
from ludic.distributed import policy_state_dict
from ludic.run.export import POLICY_DIR, export_run
from ludic.run.models import load_policy
from ludic.run.run_dir import RunDirectory
from ludic.training.checkpoint import load_checkpoint


def _weights_of_checkpoint(run_dir: Path, phase: str, step: int) -> dict[str, torch.Tensor]:
    run = RunDirectory.open(run_dir)
    policy, _ = load_policy(run.load_config(), run.model_dir)
    load_checkpoint(run.checkpoint_dir(phase) / f"step_{step:08d}", policy)
    return policy_state_dict(policy)


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    AutoTokenizer.from_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return jobs.train(_config(tmp_path_factory.mktemp("export")))


def test_a_run_leaves_its_final_policy_as_a_hugging_face_folder(run_dir: Path) -> None:
    final = _weights_of_checkpoint(run_dir, "rl", 4)
    _assert_same(_loaded(run_dir / POLICY_DIR), final)
    initial = _loaded(run_dir / "model")  # RUN_DIR/model stays the initial model
    assert any(not torch.equal(initial[n], t) for n, t in final.items())


def test_ludic_export_writes_any_kept_checkpoint(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["export", str(run_dir), str(tmp_path / "rl2"), "--step", "2"]) == EXIT_OK
    _assert_same(_loaded(tmp_path / "rl2"), _weights_of_checkpoint(run_dir, "rl", 2))
    out = tmp_path / "sft"
    assert main(["export", str(run_dir), str(out), "--phase", "warm_start"]) == EXIT_OK
    _assert_same(_loaded(out), _weights_of_checkpoint(run_dir, "warm_start", 4))
    # Exporting again replaces the folder with a complete new one.
    export_run(run_dir, out)
    _assert_same(_loaded(out), _weights_of_checkpoint(run_dir, "rl", 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl2", "sft"]  # no leftovers

    assert main(["export", str(run_dir), str(tmp_path / "x"), "--step", "3"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no step 3 to export (kept checkpoints: rl: [2, 4]; warm_start: [2, 4])" in err
    assert not (tmp_path / "x").exists()


def test_a_lora_policy_is_exported_merged(tmp_path: Path) -> None:
    run_dir = jobs.train(_config(tmp_path, "model.lora.r=4", "trainer.lr=1e-2"))
    loaded = _loaded(run_dir / POLICY_DIR)
    assert not any("lora" in name for name in loaded)
    final = _weights_of_checkpoint(run_dir, "rl", 4)  # merged: W + BA
    _assert_same(loaded, final)
    initial = _loaded(run_dir / "model")
    assert any(not torch.equal(initial[n], t) for n, t in final.items())


def test_every_checkpoint_holds_its_policy_as_a_hugging_face_folder(run_dir: Path) -> None:
    for phase in ("warm_start", "rl"):
        for step in (2, 4):
            folder = run_dir / "checkpoints" / phase / f"step_{step:08d}" / POLICY_DIR
            _assert_same(_loaded(folder), _weights_of_checkpoint(run_dir, phase, step))


def test_checkpoint_policy_false_keeps_checkpoints_lean(tmp_path: Path) -> None:
    run_dir = jobs.train(_config(tmp_path, "trainer.checkpoint_policy=false"))
    assert not (run_dir / "checkpoints" / "rl" / "step_00000004" / POLICY_DIR).exists()
    assert (run_dir / POLICY_DIR / "model.safetensors").is_file()  # the final one still is
