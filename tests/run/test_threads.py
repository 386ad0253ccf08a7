"""RunConfig.torch_threads: torch's intra-op threads leave the event loop a core."""

from __future__ import annotations

import pytest
import torch

from ludic.run.config import RunConfig
from ludic.run.threads import default_torch_threads, use_torch_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("cores", "processes", "threads"), [(8, 1, 7), (8, 2, 3), (2, 1, 1), (1, 1, 1), (2, 4, 1)]
)
def test_the_default_is_each_processs_share_of_the_cores_less_one(
    monkeypatch, cores: int, processes: int, threads: int
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert default_torch_threads(processes) == threads


def test_the_config_wins_then_omp_num_threads_then_the_default(monkeypatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert use_torch_threads(RunConfig(torch_threads=2)) == 2 == torch.get_num_threads()
    torch.set_num_threads(3)
    assert use_torch_threads(RunConfig()) == 3 == torch.get_num_threads()  # left as set
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert use_torch_threads(RunConfig()) == 2 == torch.get_num_threads()


def test_a_thread_count_below_one_names_the_field() -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        RunConfig(torch_threads=0)


def test_a_sync_runs_update_takes_every_core_unless_told_otherwise(monkeypatch) -> None:
    from ludic.run.threads import update_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert update_threads(RunConfig()) == 4
    assert update_threads(RunConfig(), processes=2) == 2
    assert update_threads(RunConfig(torch_threads=3)) == 3
    assert update_threads(RunConfig(torch_threads=3, update_threads=1)) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert update_threads(RunConfig()) is None  # torch already read it
    async_run = RunConfig.model_validate({"trainer": {"mode": "async"}})
    assert update_threads(async_run) is None  # the update runs beside generation
    with pytest.raises(ValueError, match="update_threads"):
        RunConfig(update_threads=0)


def test_the_trainer_updates_with_its_threads_and_restores_them(tiny_model) -> None:
    from ludic.training.algorithm import make_reinforce
    from ludic.training.config import TrainerConfig
    from ludic.training.trainer import Trainer
    from ludic.training.types import SAWBatch, SAWItem

    class Source:
        async def next_batch(self) -> SAWBatch:
            return SAWBatch([SAWItem([5, 6, 7, 8], [0, 0, 1, 1], weight=1.0)])

    torch.set_num_threads(1)
    seen: list[int] = []
    param = next(tiny_model.parameters())
    param.register_post_accumulate_grad_hook(lambda p: seen.append(torch.get_num_threads()))
    config = TrainerConfig(lr=1e-3, update_threads=2)
    Trainer(tiny_model, make_reinforce(), Source(), config).train_sync(2)
    assert seen == [2, 2] and torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="update_threads"):
        TrainerConfig(update_threads=0)
