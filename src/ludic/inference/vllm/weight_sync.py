"""The trainer's side of live weight sync with a ludic vLLM server (policy or reward):
form the process group with the server's workers, publish state dicts through it, leave.

Both :class:`~ludic.inference.vllm.client.VLLMChatClient` and
:class:`~ludic.inference.vllm.reward_client.VLLMRewardClient` hold one
:class:`WeightSyncSession`; the group, the transfer strategy and the publisher are the
weight-transfer layer's (``ludic.distributed.weight_transfer``), shared, not copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch

from ludic.distributed.weight_transfer.base import (
    TorchDistributedWeightSyncInfo,
    WeightUpdateRequest,
)
from ludic.distributed.weight_transfer.broadcast import GroupFailureError
from ludic.distributed.weight_transfer.deadlines import SyncProgress
from ludic.distributed.weight_transfer.verify import (
    SentChecksums,
    SyncVerificationError,
    check_reports,
)
from ludic.inference.vllm.adapter import ADAPTER_NAME, is_lora_name
from ludic.inference.vllm.canary import Canary, check_canary
from ludic.inference.vllm.http import VLLMControlPlane, VLLMServerError


class SyncStageError(RuntimeError):
    """A stage of a weight sync did not finish (a server or worker died, or stalled past
    the stage's deadline): names the stage, the servers and their ranks in the group, and
    the bytes sent so far (``ludic.distributed.weight_transfer.deadlines``)."""

    def __init__(self, message: str, *, stage: str, progress: SyncProgress) -> None:
        super().__init__(message)
        self.stage = stage
        self.progress = progress


class SyncStageTimeout(SyncStageError, TimeoutError):
    """A sync stage ran past its deadline."""


class SyncStageConnectionError(SyncStageError, ConnectionError):
    """A peer of a sync stage went away (a server, or a worker of its group)."""


STALLS = (TimeoutError, ConnectionError, GroupFailureError)
"""What a sync stage that did not finish raises (the others are refusals, named already)."""


VerifySync = Literal["every", "first", "off"]
VERIFY_SYNC: tuple[str, ...] = ("every", "first", "off")
"""When a sync is verified (``ludic.distributed.weight_transfer.verify``): after every
sync (the default), after the first only, or never."""


class WeightSyncSession:
    """Rank 0 of a weight-sync group with the workers of one server or of several.

    Args:
        control: the server's control plane, or several servers' (one group spans them
            all: each chunk is announced to every server and broadcast once to every
            worker; see :class:`FanOutControlPlane`).
        timeout_s: bound on joining, on each collective and on waiting for a sync to be
            applied.
        verify_sync: check each server's report of a sync against what was sent
            (:data:`VERIFY_SYNC`): ``"every"`` sync (the default), the ``"first"`` only, or
            ``"off"``. A sync that fails because a server restarted since the group formed
            names the restart, whatever this says.
    """

    def __init__(
        self,
        control: VLLMControlPlane | Sequence[VLLMControlPlane],
        *,
        timeout_s: float,
        verify_sync: VerifySync = "every",
    ) -> None:
        controls = [control] if isinstance(control, VLLMControlPlane) else list(control)
        if not controls:
            raise ValueError("WeightSyncSession needs at least one server's control plane")
        if verify_sync not in VERIFY_SYNC:
            raise ValueError(f"verify_sync={verify_sync!r}; expected one of {VERIFY_SYNC}")
        self.controls = controls
        self.control = FanOutControlPlane(controls) if len(controls) > 1 else controls[0]
        self.timeout_s = timeout_s
        self.verify_sync = verify_sync
        self.sender: Any = None  # the weight-transfer sender after init
        self.publisher: Any = None  # BroadcastPolicyPublisher after init
        self.boot_ids: list[str | None] = []  # each server's boot id when the group formed
        self.ranks: list[tuple[int, int]] = []  # each server's first and last rank
        self.syncs = 0  # syncs published through this group
        self.verified = 0  # syncs verified through this group
        self.canary: Canary | None = None  # the trainer's model, for the canary
        self.canary_every = 10
        self.canary_diffs: list[tuple[int | None, float]] = []  # (version, largest |diff|)
        self.canary_version: int | None = None  # a sync whose canary is due (run_canary)
        self.served_dtypes: dict[str, str] = {}  # server -> its model's dtype
        self.lora_adapter: dict[str, Any] | None = None
        """peft config of the policy's adapter: a publish of its LoRA tensors only is
        announced as an adapter-only sync (``ludic.inference.vllm.adapter``)."""

    @property
    def base_url(self) -> str:
        return ", ".join(c.policy.base_url for c in self.controls)

    def init(
        self,
        *,
        backend: str | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        strategy: Any = None,
        extractor: Any = None,
    ) -> None:
        """Form the group: ask each server for its worker count, let its workers join
        (the first server's as ranks 1..W1, the next server's after them, ..., in the
        background) and join as rank 0 (hosting the rendezvous at
        ``master_addr:master_port``, default a free port). A busy ``master_port`` raises
        ``GroupPortBusyError`` naming it before any server is asked to do anything.

        ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (default: nccl when CUDA is
        available). ``strategy`` / ``extractor`` default to ``BroadcastTransferStrategy``
        and ``ModelWeightExtractor()``; a ``CudaIpcTransferStrategy`` /
        ``PackedCudaIpcTransferStrategy`` (a trainer on the server's GPU, one server) forms
        no group: the server's workers open the IPC handles each request carries.
        """
        from ludic.distributed.broadcast_publisher import BroadcastPolicyPublisher
        from ludic.distributed.weight_transfer import (
            BroadcastTransferStrategy,
            ModelWeightExtractor,
            check_port_free,
            free_port,
        )

        if self.sender is not None:
            raise RuntimeError("init_weight_sync was already called; call close() first")
        if master_port is None:
            master_port = free_port(master_addr)
        else:  # fail now, naming the port, not when every rank's join times out
            check_port_free(master_addr, master_port)
        if strategy is None:
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            strategy = BroadcastTransferStrategy(backend=backend, timeout_s=self.timeout_s)
        self.sender = sender = self._join(strategy, master_addr, master_port)
        self.publisher = publisher = BroadcastPolicyPublisher(
            sender,
            self.control,
            extractor or ModelWeightExtractor(),
            apply_timeout_s=self.timeout_s,
        )
        publisher.control = StageTracking(self.control, lambda: publisher.progress)

    def _join(self, strategy: Any, master_addr: str, master_port: int) -> Any:
        """Have each server's workers join (in the background, ranks after the previous
        server's), join as rank 0 and wait until every worker has: the sender."""
        workers = [c.world_size() for c in self.controls]
        self.boot_ids = [c.health().get("boot_id") for c in self.controls]
        info = strategy.create_sync_info(
            master_addr=master_addr, master_port=master_port, world_size=1 + sum(workers)
        )
        name = getattr(strategy, "name", "broadcast")
        if name != "broadcast" and len(self.controls) > 1:
            raise ValueError(
                f"strategy {name!r} shares one GPU between the trainer and one server; "
                f"{len(self.controls)} servers need the broadcast strategy"
            )
        spanning = isinstance(info, TorchDistributedWeightSyncInfo)
        offset, self.ranks = 1, []
        for control, n in zip(self.controls, workers):
            self.ranks.append((offset, offset + n - 1))
            info_here = replace(info, rank_offset=offset) if spanning else info
            control.init_communicator(info_here, strategy=name)
            offset += n
        try:
            with self.stage("group init"):
                sender = strategy.create_sender(info)  # blocks until every rank has joined
        except Exception as e:
            self._note_server_error(e)
            raise
        try:
            self.control.wait_until_applied(self.timeout_s)  # raises if a worker failed
        except BaseException:
            close_quietly(sender)
            raise
        return sender

    def publish(self, params: Mapping[str, torch.Tensor], *, version: int | None) -> None:
        """Push ``params`` (served names -> tensors; a subset is fine); returns once every
        worker has loaded them, raises otherwise (with the servers' own errors attached)."""
        if self.publisher is None:
            raise RuntimeError(
                f"weight sync with {self.base_url} needs a group: call "
                "client.init_weight_sync() once before the first sync"
            )
        verify = self.verify_sync == "every" or (self.verify_sync == "first" and not self.syncs)
        self.publisher.record_checksums = verify
        nbytes = sum(t.numel() * t.element_size() for t in params.values())
        for control in self.controls:
            control.record, control.sync_bytes = verify, nbytes
        if self._adapter_sync(params):
            with self.stage("announce adapter", version):
                for control in self.controls:
                    control.post(
                        "/lora_adapter", {"name": ADAPTER_NAME, "config": self.lora_adapter}
                    )
        self.control.begin_sync()
        try:
            self.publisher.publish(params, version)
        except Exception as e:
            self._check_not_restarted(version, e)
            self._note_server_error(e)
            self._raise_stage_error(e)
            raise
        self.syncs += 1
        if not verify:
            return
        failed: list[SyncVerificationError] = []  # every server checked, then raised
        for control, boot_id in zip(self.controls, self.boot_ids):
            with self.stage("report"):
                report = control.weight_report()
            try:
                self._check_report(control.policy.base_url, report, boot_id, version)
            except SyncVerificationError as e:
                e.servers = [control.policy.base_url]
                failed.append(e)
        raise_all(failed)
        self.verified += 1
        if self._canary_due():
            self.canary_version = version

    def load_from_disk(self, path: str, *, version: int | None, expected: SentChecksums) -> None:
        """Have every server load the policy folder at ``path`` (on its own machine) as
        ``version``, one after the other, and check each one's report against
        ``expected`` (the folder's manifest) as a sync's against what was sent
        (:func:`load_verified`). Needs no group."""
        failed: list[SyncVerificationError] = []
        for control in self.controls:
            try:
                with self.stage("load from disk", version):
                    report = load_verified(
                        control, path, version=version, expected=expected, timeout_s=self.timeout_s
                    )
            except SyncVerificationError as e:
                failed.append(e)
                continue
            self.served_dtypes[control.policy.base_url] = str(report.get("dtype", ""))
        raise_all(failed)

    def _check_report(
        self, server: str, report: Mapping[str, Any], boot_id: str | None, version: int | None
    ) -> None:
        if boot_id is not None and report.get("boot_id") != boot_id:
            raise SyncVerificationError(
                f"the vLLM server at {server} restarted during the sync of version {version} "
                f"(boot id {boot_id[:8]} -> {str(report.get('boot_id'))[:8]}): it serves its "
                "checkpoint's weights"
            )
        self.served_dtypes[server] = str(report.get("dtype", ""))
        check_reports(self.publisher.last_sent, report["workers"], server=server, version=version)

    def _adapter_sync(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``params`` are the adapter's (LoRA tensors only; refused without
        :attr:`lora_adapter`)."""
        lora = [name for name in params if is_lora_name(name)]
        if not lora:
            return False
        if len(lora) < len(params):
            raise ValueError(
                "a sync mixes LoRA tensors with others (e.g. "
                f"{next(n for n in params if not is_lora_name(n))!r}); publish the adapter "
                "alone, or the merged weights"
            )
        if self.lora_adapter is None:
            raise ValueError(
                f"LoRA tensors ({lora[0]!r}, ...) need the adapter's config: call "
                "set_lora_adapter(config) first"
            )
        return True

    def run_canary(self) -> None:
        """Score the canary on every server if the last sync asked for it (its first, and
        every ``canary_every`` syncs after it); raise :class:`SyncVerificationError` on a
        mismatch. Called once the servers serve again (after ``/resume``): a paused server
        would hold the canary's request."""
        canary, version, self.canary_version = self.canary, self.canary_version, None
        if canary is None or version is None:
            return
        trained = canary.trained()
        for control in self.controls:
            server = control.policy.base_url
            served = canary.served(control)
            dtypes = [canary.dtype, self.served_dtypes.get(server) or canary.dtype]
            worst = check_canary(
                served,
                trained,
                canary.ids,
                dtypes=dtypes,
                server=server,
                version=version,
                what=canary.what,
            )
            self.canary_diffs.append((version, worst))

    @contextlib.contextmanager
    def stage(self, name: str, version: int | None = None) -> Iterator[None]:
        """Run a stage of the current sync (``pause``, ``resume``, ``report``, ...): a stall
        or a dead peer raises :class:`SyncStageError` naming it."""
        progress = self.publisher.progress if self.publisher is not None else SyncProgress()
        if version is not None and progress.version != version:
            progress = SyncProgress(version=version)  # a stage before the publish
            if self.publisher is not None:
                self.publisher.progress = progress
        progress.enter(name)
        try:
            yield
        except Exception as e:
            self._raise_stage_error(e, progress)
            raise

    def _raise_stage_error(self, error: Exception, progress: SyncProgress | None = None) -> None:
        """Raise :class:`SyncStageError` from ``error`` if it is a stall or a dead peer."""
        if not isinstance(error, STALLS) or isinstance(error, SyncStageError):
            return
        if progress is None:
            progress = self.publisher.progress if self.publisher is not None else SyncProgress()
        if isinstance(error, GroupFailureError):
            kind = SyncStageTimeout if error.timed_out else SyncStageConnectionError
        else:
            kind = SyncStageTimeout if isinstance(error, TimeoutError) else SyncStageConnectionError
        servers = ", ".join(
            f"{c.policy.base_url} (ranks {a}..{b})" if b > a else f"{c.policy.base_url} (rank {a})"
            for c, (a, b) in zip(self.controls, self.ranks or [(1, 1)] * len(self.controls))
        )
        raise kind(
            f"weight sync with {servers} stopped in {progress.describe()}: "
            f"{type(error).__name__}: {error}",
            stage=progress.stage,
            progress=progress,
        ) from error

    def _canary_due(self) -> bool:
        """The canary runs on the first sync and every ``canary_every`` syncs after it."""
        if self.canary is None or self.canary_every <= 0:
            return False
        return (self.syncs - 1) % self.canary_every == 0

    def _check_not_restarted(self, version: int | None, error: Exception) -> None:
        """After a failed sync (a restarted server refuses the first chunk: it has no
        group): raise :class:`SyncVerificationError` from ``error`` naming a server whose
        boot id changed since the group formed. It restarted, lost every weight synced to
        it and left the group."""
        for control, boot_id in zip(self.controls, self.boot_ids):
            try:
                now = control.health().get("boot_id")
            except (ConnectionError, TimeoutError, VLLMServerError):
                continue  # a dead server: the sync itself fails, naming it
            if boot_id is not None and now != boot_id:
                raise SyncVerificationError(
                    f"the vLLM server at {control.policy.base_url} restarted since the "
                    f"weight-sync group formed (boot id {boot_id[:8]} -> {str(now)[:8]}): it "
                    "serves its checkpoint's weights, not the trainer's, and left the group; "
                    f"the sync of version {version} did not reach it ({type(error).__name__}: "
                    f"{error})"
                ) from error

    def close(self) -> None:
        """Leave the group (telling the servers, if they still answer)."""
        sender, self.sender, self.publisher = self.sender, None, None
        if sender is not None:
            for control in self.controls:
                # a server may be gone or broken; release our side regardless
                with contextlib.suppress(ConnectionError, TimeoutError, VLLMServerError):
                    control.close_communicator()
            close_quietly(sender)

    def _note_server_error(self, error: Exception) -> None:
        """Let the servers settle what they were given and attach their side of the
        failure."""
        for control in self.controls:
            server_error = control.settle(self.timeout_s)
            if server_error:
                error.add_note(f"vLLM server at {control.policy.base_url} reported: {server_error}")


class StageTracking:
    """The publisher's control plane with the sync's stage kept current: ``announce``
    while a chunk is announced, ``broadcast`` after it (the sender moves the bytes)."""

    def __init__(self, inner: Any, progress: Callable[[], SyncProgress]) -> None:
        self.inner = inner
        self.progress = progress

    def announce(self, request: WeightUpdateRequest) -> None:
        self.progress().enter("announce")
        self.inner.announce(request)
        self.progress().enter("broadcast")

    def wait_until_applied(self, timeout_s: float) -> None:
        self.inner.wait_until_applied(timeout_s)


class FanOutControlPlane:
    """Several servers' control planes as one ``ControlPlane`` (a weight-sync group that
    spans them all): a chunk is announced to every server; an update is applied when
    every server has applied it."""

    def __init__(self, controls: Sequence[VLLMControlPlane]) -> None:
        self.controls = list(controls)

    def announce(self, request: WeightUpdateRequest) -> None:
        for control in self.controls:
            control.announce(request)

    def wait_until_applied(self, timeout_s: float) -> None:
        """Wait for every server (each within ``timeout_s``); raise the first failure,
        the others' attached as notes."""
        errors: list[Exception] = []
        for control in self.controls:
            try:
                control.wait_until_applied(timeout_s)
            except Exception as e:
                errors.append(e)
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"also: {type(other).__name__}: {other}")
            raise errors[0]

    def begin_sync(self) -> None:
        for control in self.controls:
            control.begin_sync()


def load_verified(
    control: VLLMControlPlane,
    path: str,
    *,
    version: int | None,
    expected: SentChecksums,
    timeout_s: float,
) -> dict[str, Any]:
    """Have the server of ``control`` load the policy folder at ``path`` (on its machine)
    as ``version`` and check its workers' report against ``expected``, as a sync's against
    what was sent; returns the report. :class:`SyncVerificationError` names the server."""
    control.load_weights_from_disk(path, version, timeout_s)
    report = control.weight_report()
    server = control.policy.base_url
    try:
        check_reports(expected, report["workers"], server=server, version=version)
    except SyncVerificationError as e:
        e.servers = [server]
        raise
    return report


def raise_all(failed: Sequence[SyncVerificationError]) -> None:
    """Raise the first of ``failed`` (the others noted on it, their servers added), if any."""
    if not failed:
        return
    for other in failed[1:]:
        failed[0].add_note(f"also: {other}")
        failed[0].servers += other.servers
    raise failed[0]


def close_quietly(sender: Any) -> None:
    close = getattr(sender, "close", None) or getattr(getattr(sender, "pg", None), "shutdown", None)
    if close is not None:
        with contextlib.suppress(Exception):  # a broken group may refuse to shut down
            close()
