"""The trainer processes of a ``trainer.world_size > 1`` run (FSDP2 over torch.distributed).

``ludic train`` starts them with torchrun (:func:`torchrun_command`); each joins the process
group (:func:`join_trainer_group`: NCCL, one GPU each, on ``model.device: cuda``; else
gloo). Rank 0 runs the job as a single process would, its Trainers built with ``ranks``;
the others :func:`follow`: the same policy, Trainers and steps, each step's batch from rank
0 (:mod:`ludic.training.data_parallel`), joining every collective rank 0 makes (optimizer
steps, publishes, ``torch.distributed.checkpoint`` checkpoints, and the policy folders rank
0 writes from the gathered weights, :func:`~ludic.run.export.save_policy`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ludic.inference.vllm.process import die_with_parent_preexec
from ludic.run.builders import RunError, make_algorithm
from ludic.run.config import RunConfig
from ludic.run.export import POLICY_DIR, save_policy
from ludic.run.models import load_policy
from ludic.run.phases import make_trainer
from ludic.run.run_dir import RunDirectory
from ludic.run.steps import run_steps
from ludic.training.algorithm import make_sft
from ludic.training.data_parallel import TrainerRanks, broadcast_text

__all__ = [
    "follow",
    "join_trainer_group",
    "leave_trainer_group",
    "run_as_ranks",
    "save_policy",  # re-exported from ludic.run.export
    "share_run_dir",
    "torchrun_command",
]

GROUP_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits in a collective (e.g. for rank 0's next batch, while rank 0
samples or evaluates) before failing; a pipeline learner adds ``pipeline.batch_timeout_s``
(:func:`group_timeout`)."""


def group_timeout(config: RunConfig) -> timedelta:
    """:data:`GROUP_TIMEOUT`, plus the time a pipeline learner's rank 0 may wait for a
    batch in the queue (it fails after that, so the others never time out first)."""
    if config.trainer.mode == "pipeline":
        return GROUP_TIMEOUT + timedelta(seconds=config.pipeline.batch_timeout_s)
    return GROUP_TIMEOUT


def torchrun_command(world_size: int, argv: list[str]) -> list[str]:
    """``python -m torch.distributed.run`` starting ``world_size`` processes of
    ``python -m ludic ARGV`` on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "-m",
        "ludic",
        *argv,
    ]


def join_trainer_group(config: RunConfig) -> TrainerRanks | None:
    """Join the default process group as ``RANK`` of ``WORLD_SIZE``; ``None`` for
    ``trainer.world_size: 1``. Under torchrun through its rendezvous; otherwise (the
    ranks ``ludic launch`` places on Ray) at ``MASTER_ADDR:MASTER_PORT``, where rank 0
    hosts the store on that address only (:func:`_rendezvous_store`). Raises a
    :class:`RunError` without those variables or when the world size is not the config's."""
    import torch
    import torch.distributed as dist

    wanted = config.trainer.world_size
    if wanted == 1:
        return None
    ranks = TrainerRanks.from_env()
    if ranks is None:
        raise RunError(
            f"trainer.world_size={wanted} needs {wanted} processes: run `ludic train` (it "
            f"starts them with torchrun) or torchrun --nproc-per-node {wanted} -m ludic train ..."
        )
    if ranks.world_size != wanted:
        raise RunError(
            f"trainer.world_size={wanted} but {ranks.world_size} processes were started "
            "(WORLD_SIZE)"
        )
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if torchrun:
        # torchrun starts each rank in a session of its own: one that outlived torchrun
        # (``kill -9`` of it or of the launcher) would hold the group's port forever
        die_with_parent_preexec(os.getppid())()
    cuda = config.model.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", ranks.rank)))
    timeout = group_timeout(config)
    # gloo for the CPU tensors of the batch channel and flags, NCCL for the model's
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if torchrun:
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = _rendezvous_store(ranks, timeout)
        dist.init_process_group(
            backend, store=store, rank=ranks.rank, world_size=ranks.world_size, timeout=timeout
        )
    return TrainerRanks.current()


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT")
"""Where the ranks of a group started without torchrun meet (rank 0 hosts the store)."""


def _rendezvous_store(ranks: TrainerRanks, timeout: timedelta) -> Any:
    """The group's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``: rank 0 hosts it on a
    socket bound to that address alone (a store left to bind by itself listens on every
    interface), the others connect."""
    from torch.distributed import TCPStore

    from ludic.distributed.weight_transfer.groups import listening_socket

    missing = [name for name in RENDEZVOUS_ENV if not os.environ.get(name)]
    if missing:
        raise RunError(
            f"trainer.world_size={ranks.world_size}: rank {ranks.rank} was started without "
            f"torchrun and without {' and '.join(missing)} (the address and port where rank 0 "
            "hosts the group's rendezvous)"
        )
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return TCPStore(
        host,
        port,
        ranks.world_size,
        is_master=ranks.is_main,
        timeout=timeout,
        wait_for_workers=False,  # init_process_group waits for every rank
        master_listen_fd=listening_socket(host, port) if ranks.is_main else None,
    )


def run_as_ranks(
    config: RunConfig, lead: Callable[[TrainerRanks | None], Path], *, resume: bool
) -> Path:
    """This process's part of a run: with ``trainer.world_size: 1`` (or as rank 0 of a
    group) ``lead(ranks)``; as another rank, :func:`follow`. The group is joined first and
    left last (after a failure without waiting for the others: torchrun, or the launcher
    on Ray, stops them). Returns the run directory."""
    ranks = join_trainer_group(config)
    try:
        if ranks is not None and not ranks.is_main:
            path = follow(config, ranks, resume=resume)
        else:
            path = lead(ranks)
    except BaseException:
        if ranks is not None:
            leave_trainer_group(failed=True)
        raise
    if ranks is not None:
        leave_trainer_group()
    return path


def leave_trainer_group(*, failed: bool = False) -> None:
    """Free what is left of the sharded models, wait for every rank, then destroy the
    default group. FSDP modules sit in reference cycles: collected only at interpreter
    exit, their pending gloo work (holding tensors) would be destroyed after Python is
    gone, and the process aborts ("terminate called without an active exception")."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        if not failed:  # after a failure the other ranks sit in another collective
            dist.barrier()
        dist.destroy_process_group()


def share_run_dir(path: Path | None, ranks: TrainerRanks) -> Path:
    """Rank 0's run directory on every rank (rank 0 passes it, the others ``None``)."""
    return Path(broadcast_text(str(path) if path is not None else None, ranks))


def follow(config: RunConfig, ranks: TrainerRanks, *, resume: bool) -> Path:
    """A following rank's run: rank 0's steps and collectives, in rank 0's order (see the
    module docstring). Returns the run directory."""
    run = RunDirectory.open(share_run_dir(None, ranks))
    config = run.load_config()
    policy, tokenizer = load_policy(config, run.model_dir)
    every = config.trainer.checkpoint_every
    if config.warm_start.steps > 0 and not run.has_checkpoint("rl"):
        trainer = make_trainer(
            config, run, "warm_start", policy, tokenizer, None, make_sft(), ranks=ranks
        )
        if resume and run.has_checkpoint("warm_start"):
            trainer.resume()
        run_steps(trainer, config.warm_start.steps - trainer.step, every=every)
        save_policy(policy, tokenizer, run.path / POLICY_DIR, ranks)
    algorithm = make_algorithm(config)
    trainer = make_trainer(config, run, "rl", policy, tokenizer, None, algorithm, ranks=ranks)
    if resume and run.has_checkpoint("rl"):
        trainer.resume()
    trainer.publish_policy()  # with rank 0's first publish
    run_steps(trainer, config.trainer.steps - trainer.step, every=every)
    save_policy(policy, tokenizer, run.path / POLICY_DIR, ranks)
    return run.path
