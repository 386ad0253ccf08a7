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
