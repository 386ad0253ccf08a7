"""CheckpointManager: round trip, retention, atomic layout, RNG restore, clear errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ludic.training.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
from ludic.training.config import TrainerConfig
from ludic.training.optim import build_lr_scheduler, build_optimizer


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    config = TrainerConfig(lr=0.1, lr_schedule="linear", total_steps=10)
    optimizer = build_optimizer(model, config)
    return model, optimizer, build_lr_scheduler(optimizer, config)


def _train_one_step(model, optimizer, scheduler) -> None:
    model(torch.ones(2, 4)).pow(2).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_save_then_load_restores_model_optimizer_scheduler_and_extra(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path, every_n_steps=1))
    model, optimizer, scheduler = _setup(seed=0)
    _train_one_step(model, optimizer, scheduler)
    path = manager.save(1, model, optimizer, scheduler, extra={"algorithm": "sft"})

    other, other_opt, other_sched = _setup(seed=1)
    loaded = manager.load(path, other, other_opt, other_sched)

    assert loaded.step == 1 and loaded.extra == {"algorithm": "sft"}
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    state, other_state = optimizer.state_dict()["state"], other_opt.state_dict()["state"]
    assert torch.equal(state[0]["exp_avg"], other_state[0]["exp_avg"])
    assert other_sched.get_last_lr() == scheduler.get_last_lr()


def test_load_restores_python_numpy_and_torch_rng_states(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path))
    model, optimizer, scheduler = _setup()
    path = manager.save(5, model, optimizer, scheduler)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    manager.load(path, model)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_retention_keeps_only_the_last_k_checkpoints(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path, every_n_steps=1, keep_last=2))
    model, optimizer, scheduler = _setup()
    for step in (1, 2, 3, 4):
        manager.save(step, model, optimizer, scheduler)

    assert [p.name for p in manager.checkpoints()] == ["step_00000003", "step_00000004"]
    assert manager.latest() == tmp_path / "step_00000004"
    assert not list(tmp_path.glob(".tmp-*"))  # written via a temporary folder, then renamed


def test_incomplete_checkpoint_folders_are_ignored_by_latest(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path))
    model, optimizer, scheduler = _setup()
    manager.save(1, model, optimizer, scheduler)
    (tmp_path / "step_00000009").mkdir()  # e.g. a crash mid-copy: no trainer_state.json
    (tmp_path / ".tmp-step_00000010").mkdir()
    assert manager.latest() == tmp_path / "step_00000001"


def test_is_due_every_n_steps_and_never_when_zero(tmp_path) -> None:
    every_3 = CheckpointManager(CheckpointConfig(tmp_path, every_n_steps=3))
    assert [s for s in range(1, 10) if every_3.is_due(s)] == [3, 6, 9]
    assert not CheckpointManager(CheckpointConfig(tmp_path, every_n_steps=0)).is_due(5)


def test_loading_a_checkpoint_with_missing_files_names_them(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path))
    model, optimizer, scheduler = _setup()
    path = manager.save(1, model, optimizer, scheduler)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        manager.load(path, model, optimizer)


def test_loading_a_corrupt_checkpoint_raises_checkpoint_error(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path))
    model, optimizer, scheduler = _setup()
    path = manager.save(1, model, optimizer, scheduler)
    (path / "model.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="corrupt"):
        manager.load(path, model)


def test_loading_into_a_different_model_raises_checkpoint_error(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path))
    model, optimizer, scheduler = _setup()
    path = manager.save(1, model, optimizer, scheduler)
    with pytest.raises(CheckpointError, match="different model"):
        manager.load(path, torch.nn.Linear(5, 3))


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"every_n_steps": -1}, "every_n_steps"), ({"keep_last": 0}, "keep_last")]
)
def test_checkpoint_config_rejects_invalid_values_naming_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=f"CheckpointConfig.{field}"):
        CheckpointConfig(tmp_path, **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30])
def test_non_finite_or_exploded_weights_are_never_checkpointed(tmp_path, bad) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path, every_n_steps=1))
    model, optimizer, scheduler = _setup()
    with torch.no_grad():
        model.weight[0, 0] = bad
    with pytest.raises(CheckpointError, match=r"not saving checkpoint step 3 .*weights"):
        manager.save(3, model, optimizer, scheduler)
    assert manager.checkpoints() == [] and not any(tmp_path.iterdir())


def test_an_exploding_optimizer_step_raises_naming_the_step_and_the_fix() -> None:
    from ludic.training.optim import DivergedError, clipped_optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = build_optimizer(model, TrainerConfig(lr=1e30))
    scheduler = build_lr_scheduler(optimizer, TrainerConfig(lr=1e30))

    def abort(reason: str):
        raise AssertionError(reason)

    model(torch.ones(2, 4)).pow(2).sum().backward()
    with pytest.raises(DivergedError, match=r"optimizer step 1 \(lr=1e\+30.*exploded.*trainer\.lr"):
        clipped_optimizer_step(model, optimizer, scheduler, None, abort=abort)


def test_saving_over_an_existing_step_replaces_it_whole(tmp_path) -> None:
    manager = CheckpointManager(CheckpointConfig(tmp_path, every_n_steps=1))
    model, optimizer, scheduler = _setup()
    manager.save(1, model, optimizer, scheduler, extra={"n": 1})
    path = manager.save(1, model, optimizer, scheduler, extra={"n": 2})
    assert manager.load(path, model).extra == {"n": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
