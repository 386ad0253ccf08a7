"""How many CPU threads torch's ops use in a run's process (``RunConfig.torch_threads``).

A run's process does two kinds of CPU work at once: torch's ops (sampling with the
in-process backend, the update), parallelized over an OpenMP team, and the event loop
(envs, the agent, chat templates, tokenization, rewards, logging). Torch's default team has
one thread per usable core; the event loop then takes a core from the team, and every
parallel op waits at its barrier for the thread the event loop displaced. On 2 cores, a
step of the demo's model was faster with one thread than with two (``benchmarks/vs_trl.py
split --cores 0,1 [torch_threads=2]``; figures in ``benchmarks/README.md``). The default
leaves the event loop a core.

The update of a synchronous run is the exception: the event loop waits for it, and its ops
(a whole batch's forward and backward) are big enough to gain from every core, which the
sampler's are not (``RunConfig.update_threads``; ``benchmarks/vs_trl.py split
update_threads=1``).
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
