"""How many CPU threads torch's ops use in a run's process (``RunConfig.torch_threads``).

Torch's OpenMP team (sampling in process, the update) shares the CPU with the event loop
(envs, agent, chat templates, rewards, logging). A team of one thread per core loses a core
to the event loop, and every parallel op waits at its barrier for the displaced thread, so
the default leaves the event loop a core (figures in ``benchmarks/README.md``). A
synchronous run's update is the exception (``RunConfig.update_threads``): the event loop
waits for it, and its batch-sized ops gain from every core.
"""

from __future__ import annotations

import os

import torch

from ludic.run.config import RunConfig

__all__ = ["default_torch_threads", "update_threads", "use_torch_threads"]


def default_torch_threads(processes: int = 1) -> int:
    """The usable cores (this process's CPU affinity) shared by ``processes`` processes,
    less one for each process's event loop; at least 1."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, processes) - 1)


def use_torch_threads(config: RunConfig, *, processes: int = 1) -> int:
    """Set torch's intra-op threads for this process and return the number: the config's
    ``torch_threads``, else ``OMP_NUM_THREADS`` when set (torch already read it), else
    :func:`default_torch_threads`."""
    if config.torch_threads is not None:
        threads = config.torch_threads
    elif os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    else:
        threads = default_torch_threads(processes)
    torch.set_num_threads(threads)
    return threads


def update_threads(config: RunConfig, *, processes: int = 1) -> int | None:
    """Torch's threads during a synchronous run's update (``TrainerConfig.update_threads``):
    the config's ``update_threads``, else its ``torch_threads``, else (``OMP_NUM_THREADS``
    unset) every usable core shared by ``processes`` processes; ``None`` (leave torch's
    setting) with ``OMP_NUM_THREADS`` set or outside ``trainer.mode: sync``."""
    if config.trainer.mode != "sync":
        return None
    if config.update_threads is not None:
        return config.update_threads
    if config.torch_threads is not None:
        return config.torch_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, len(os.sched_getaffinity(0)) // max(1, processes))
