"""Stateless process groups: argument checks and bounded joining (in process).

Collectives across real processes are covered in ``test_weight_transfer_broadcast.py``
(its receiver pool runs ``broadcast`` and ``all_reduce_max`` over a three-rank group).
"""

from __future__ import annotations

import time

import pytest
import torch

from ludic.distributed.weight_transfer import free_port, init_process_group
from ludic.distributed.weight_transfer.groups import FREE_PORT_FLOOR


def test_joining_raises_within_the_timeout_when_a_rank_never_comes() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        init_process_group(
            master_addr="127.0.0.1", master_port=free_port(), rank=0, world_size=2, timeout_s=1.0
        )
    assert time.monotonic() - start < 15.0


def test_the_group_is_not_registered_with_torch_distributed() -> None:
    # A lone rank of a 2-rank group fails to form, but must not have touched global state.
    with pytest.raises(RuntimeError):
        init_process_group(
            master_addr="127.0.0.1", master_port=free_port(), rank=0, world_size=2, timeout_s=0.5
        )
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "mpi"}, "expected one of"),
        ({"world_size": 1}, "world_size >= 2"),
        ({"rank": 2}, "0 <= rank < world_size"),
    ],
)
def test_bad_arguments_are_rejected_before_any_network_call(kwargs, match) -> None:
    args = {"master_addr": "127.0.0.1", "master_port": 1, "rank": 0, "world_size": 2}
    with pytest.raises(ValueError, match=match):
        init_process_group(**{**args, **kwargs})


def test_free_port_avoids_the_ephemeral_range() -> None:
    """Finding: a group port picked from the ephemeral range was taken, while its vLLM server
    was starting, by a socket the engine bound to port 0 (CI: "group port 40021 is busy").
    Ports are now picked below that range, which the kernel never hands out for port 0."""
    import socket

    from ludic.distributed.weight_transfer.groups import _ephemeral_low

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(FREE_PORT_FLOOR <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned
    kernel_picked = set()
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            kernel_picked.add(s.getsockname()[1])
    assert all(p >= low for p in kernel_picked)
