"""Stateless process groups: trainer and inference workers meet without ``init_process_group``.

The trainer is rank 0 and hosts the ``TCPStore`` at ``master_addr:master_port`` (bound to that
address only); workers are ranks ``1..world_size-1``. The group (gloo or NCCL over a
``PrefixStore``) is not registered with ``torch.distributed``, so it sits beside FSDP's or
vLLM's groups: use :func:`broadcast` / :func:`all_reduce_max`, never ``torch.distributed``'s
functions with ``group=pg``. Joining blocks until every rank joined (the trainer triggers the
workers' join first or meanwhile); ``timeout_s`` bounds it and every later operation. The store
keys are vLLM's ``stateless_init_torch_distributed_process_group``'s: either side may use it.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ReduceOp, TCPStore

BACKENDS = ("gloo", "nccl")


def init_process_group(
    *,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> ProcessGroup:
    """Join (rank > 0) or host (rank 0) a stateless ``world_size``-rank group.

    ``backend="gloo"`` moves CPU tensors; ``backend="nccl"`` moves CUDA tensors of the
    current device (call ``torch.cuda.set_device`` first). Raises ``RuntimeError`` if the
    group cannot form within ``timeout_s`` (e.g. a rank never joined), and
    :class:`GroupPortBusyError` at once when rank 0 finds ``master_port`` taken.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS} (gloo: CPU, nccl: GPU)")
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank}, world_size={world_size}; need world_size >= 2 (trainer + workers) "
            "and 0 <= rank < world_size"
        )
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        raise RuntimeError(
            "backend='nccl' needs a CUDA build of torch with NCCL; use backend='gloo' on CPU"
        )
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        # The group constructor below waits for every rank; the store need not.
        wait_for_workers=False,
        master_listen_fd=listening_socket(master_addr, master_port) if rank == 0 else None,
    )
    prefix_store = PrefixStore(f"tcp://{master_addr}:{master_port}", store)
    pg = ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        backend_impl = ProcessGroupGloo(prefix_store, rank, world_size, timeout=timeout)
        backend_type, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend_impl = ProcessGroupNCCL(prefix_store, rank, world_size, options)
        backend_type, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    pg._set_default_backend(backend_type)
    backend_impl._set_sequence_number_for_group()
    pg._register_backend(device, backend_type, backend_impl)
    return pg


def broadcast(
    pg: ProcessGroup, tensor: torch.Tensor, src: int = 0, *, timeout_s: float | None = None
) -> None:
    """Broadcast ``tensor`` in place from rank ``src`` to every rank of ``pg``.

    ``timeout_s`` (default: the group's timeout) bounds the wait; a dead or silent peer
    raises ``RuntimeError``.
    """
    wait(broadcast_async(pg, tensor, src, timeout_s=timeout_s), timeout_s)


def broadcast_async(
    pg: ProcessGroup, tensor: torch.Tensor, src: int = 0, *, timeout_s: float | None = None
) -> torch.distributed.Work:
    """Start a broadcast and return its work; finish it with :func:`wait`. Every rank must
    start the same broadcasts in the same order."""
    return pg.broadcast(tensor, root=src, timeout=_timedelta(timeout_s))


def all_reduce_max(
    pg: ProcessGroup, tensor: torch.Tensor, *, timeout_s: float | None = None
) -> None:
    """Replace ``tensor`` in place by its elementwise max over every rank of ``pg``."""
    wait(all_reduce_max_async(pg, tensor, timeout_s=timeout_s), timeout_s)


def all_reduce_max_async(
    pg: ProcessGroup, tensor: torch.Tensor, *, timeout_s: float | None = None
) -> torch.distributed.Work:
    """Start :func:`all_reduce_max` and return its work; finish it with :func:`wait`."""
    return pg.allreduce(tensor, op=ReduceOp.MAX, timeout=_timedelta(timeout_s))


def wait(work: torch.distributed.Work, timeout_s: float | None = None) -> None:
    """Block until ``work`` is done (at most ``timeout_s``, default the group's timeout)."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))


class GroupPortBusyError(RuntimeError):
    """The weight-sync rendezvous port is already taken on the trainer's machine."""


def listening_socket(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only, for the store to take over (its fd);
    :class:`GroupPortBusyError` when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen()
    except OSError as e:
        s.close()
        raise _port_busy(host, port, e) from None
    return s.detach()


def _port_busy(host: str, port: int, e: OSError) -> GroupPortBusyError:
    return GroupPortBusyError(
        f"weight-sync group port {port} on {host} is busy ({e.strerror}): another "
        "process listens there. Choose a free port (inference.vllm.group_port, or "
        "null for a free one) or stop that process"
    )


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`GroupPortBusyError` naming ``host:port`` when a listener cannot bind
    it now. Rank 0 checks before hosting the store: a busy port otherwise surfaces only
    when every rank's join times out (minutes)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise _port_busy(host, port, e) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (for tests and single-machine setups).

    Chosen at random below the kernel's ephemeral range (``ip_local_port_range``) where
    there is room: a port is usually bound a while after it is picked (a vLLM server binds
    its HTTP and weight-sync ports only after loading), and in between any process that
    binds port 0 gets an ephemeral port (a starting vLLM engine opens several), which
    could be this one if it came from the ephemeral range. Falls back to a port the
    kernel picks.
    """
    low = _ephemeral_low()
    if low - FREE_PORT_FLOOR >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(FREE_PORT_FLOOR, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


FREE_PORT_FLOOR = 20000
"""The lowest port :func:`free_port` picks (well-known service ports lie below)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts there


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _timedelta(timeout_s: float | None) -> timedelta | None:
    return None if timeout_s is None else timedelta(seconds=timeout_s)
