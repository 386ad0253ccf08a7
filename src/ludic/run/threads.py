"""How many CPU threads torch's ops use in a run's process (``RunConfig.torch_threads``).

A run's process does two kinds of CPU work at once: torch's ops (sampling with the
in-process backend, the update), parallelized over an OpenMP team, and the event loop
(envs, the agent, chat templates, tokenization, rewards, logging). Torch's default team has
one thread per usable core; the event loop then takes a core from the team, and every
parallel op waits at its barrier for the thread the event loop displaced. On 2 cores, a
step of the demo's model was faster with one thread than with two (``benchmarks/vs_trl.py
split --cores 0,1 [torch_threads=2]``; figures in ``benchmarks/README.md``). The default
leaves the event loop a core.
"""

from __future__ import annotations

import os

import torch

from ludic.run.config import RunConfig

__all__ = ["default_torch_threads", "use_torch_threads"]


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
