"""vLLM worker extension: the inference side of ludic's weight sync
(``--worker-extension-cls ludic.inference.vllm.worker.WeightSyncWorkerExtension``, the server's
default; called through ``engine.collective_rpc`` with JSON-shaped arguments, never pickles).

The transfer layer's receiver moves each chunk and ``VLLMWeightLoader`` loads it. Added here:
every name and shape is checked against the served checkpoint before the model is touched (a
failed vLLM load kills the engine); a CPU worker loads a sync's chunks together with the ``last``
one (vLLM's layerwise reload rebuilds a fused layer from one call) and refuses part of a fused
layer; a failed load restores the previous weights (best effort); the ``weight_report``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

# Imported with the extension (at worker start), not at the first /init_communicator: on
# a busy CPU (several servers spinning) a first import there took longer than the join
# timeout of the other ranks.
from ludic.distributed.weight_transfer import (
    BroadcastTransferStrategy,
    EmptyWeightSyncInfo,
    TorchDistributedWeightSyncInfo,
    VLLMWeightLoader,
    create_strategy,
    sync_info_from_dict,
)
from ludic.inference.vllm.adapter import is_lora_name
from ludic.inference.vllm.adapter_loader import adapter_report, load_adapter, write_adapter
from ludic.inference.vllm.load_report import LoadRecorder

logger = logging.getLogger(__name__)


class WeightSyncWorkerExtension:
    """Mixed into each vLLM worker (which provides ``self.rank`` and ``self.model_runner``).

    Attributes use a ``ludic_`` prefix so they cannot clash with the worker's own.
    """

    ludic_receiver: Any = None
    ludic_join: GroupJoin | None = None  # a join of the trainer's group in progress
    ludic_loader: Any = None
    ludic_pending: dict[str, torch.Tensor] | None = None  # CPU: chunks of the current sync
    ludic_sync_failed: bool = False  # a chunk of the current sync failed: load nothing
    ludic_checkpoint: dict[str, list[int]] | None = None  # served checkpoint: name -> shape
    ludic_recorder: LoadRecorder | None = None  # sums of the current sync (verification)
    ludic_report: dict[str, Any] | None = None  # the last loaded sync's report
    ludic_adapter_next: dict[str, Any] | None = None  # announced: the next sync's adapter
    ludic_adapter: dict[str, Any] | None = None  # the current sync's adapter, if any

    def init_communicator(
        self, sync_info: dict[str, Any], rank_offset: int, strategy: str = "broadcast"
    ) -> None:
        """Start joining the trainer's group as rank ``rank_offset + self.rank`` (the
        trainer is rank 0, so the server passes ``rank_offset=1``). The join runs in a
        thread and this returns at once, so the engine keeps generating while the worker
        waits for the trainer; poll :meth:`communicator_status`.

        ``strategy`` ``cuda_ipc`` / ``packed_cuda_ipc``: a trainer on this worker's GPU;
        no group: the receiver that opens the requests' IPC handles is built now."""
        self.close_communicator()
        if strategy != "broadcast":
            self.ludic_receiver = create_strategy(strategy).create_receiver(EmptyWeightSyncInfo())
            if self.ludic_checkpoint is None:
                self.ludic_checkpoint = checkpoint_shapes(
                    self.model_runner.vllm_config.model_config
                )  # type: ignore[attr-defined]
            return
        info = sync_info_from_dict(sync_info)
        if not isinstance(info, TorchDistributedWeightSyncInfo):
            raise ValueError(f"init_communicator needs a process-group sync info, got {sync_info}")
        rank = rank_offset + int(self.rank)  # type: ignore[attr-defined]
        strategy = BroadcastTransferStrategy(backend=info.backend, timeout_s=info.timeout_s)
        if self.ludic_checkpoint is None:
            self.ludic_checkpoint = checkpoint_shapes(self.model_runner.vllm_config.model_config)  # type: ignore[attr-defined]
        where = f"{info.group_name} ({info.master_addr}:{info.master_port}) as rank {rank}"
        self.ludic_join = GroupJoin(
            lambda: strategy.create_receiver(info, rank=rank), where, info.timeout_s
        )

    def communicator_status(self) -> dict[str, Any]:
        """``{"state": "none" | "joining" | "joined" | "failed", "error": str | None}``."""
        if self.ludic_receiver is not None:
            return {"state": "joined", "error": None}
        if self.ludic_join is None:
            return {"state": "none", "error": None}
        status = self.ludic_join.status()
        if status["state"] == "joined":
            self._joined_receiver()
        return status

    def update_param_batch(
        self, request: dict[str, Any], first: bool = False, record: bool = True
    ) -> int:
        """Receive the announced chunk and load it (CPU: with the sync's ``last`` chunk).

        ``first`` marks the first chunk of a sync (drops what a failed sync left behind);
        with ``record`` false the sync's checksums are not taken (nothing verifies it).
        Returns the number of tensors loaded by this call.
        """
        receiver = self._joined_receiver()
        if first or self.ludic_pending is None:
            self.ludic_pending, self.ludic_sync_failed = {}, False
            self.ludic_recorder = self._new_recorder() if record else None
            self.ludic_adapter, self.ludic_adapter_next = self.ludic_adapter_next, None
        recorder = self.ludic_recorder
        parsed = receiver.parse_request(request)
        try:
            named = receiver.receive(parsed)
            check_adapter_names(named, adapter=self.ludic_adapter is not None)
            if recorder is not None:
                recorder.receive(named)
        except Exception:
            self.ludic_sync_failed = True
            raise
        if self.ludic_adapter is not None:  # kept (copied off IPC memory) until the last
            if parsed.kind != "broadcast":
                named = {k: v.clone() for k, v in named.items()}
                torch.cuda.current_stream().synchronize()
        elif not self._is_cpu():
            self._load(named)
            if parsed.kind != "broadcast":  # IPC tensors alias the trainer's memory:
                torch.cuda.current_stream().synchronize()  # copied before it may reuse it
            if parsed.last and recorder is not None:
                self._finish_sync(recorder, parsed.version)
            return len(named)
        if not self.ludic_sync_failed:
            self.ludic_pending.update(named)
        if not parsed.last:
            return 0
        pending, self.ludic_pending = self.ludic_pending, {}
        failed, self.ludic_sync_failed = self.ludic_sync_failed, False
        if failed:
            self.ludic_recorder = None
            raise RuntimeError("nothing loaded: an earlier chunk of this sync failed")
        if self.ludic_adapter is not None:
            adapter, self.ludic_adapter = self.ludic_adapter, None
            self._load_adapter(adapter, pending, recorder, parsed.version)
            return len(pending)
        if recorder is None:
            self._load(pending)
            return len(pending)
        with recorder.capturing():  # reads each layer before vLLM pre-packs it
            self._load(pending)
        self._finish_sync(recorder, parsed.version)
        return len(pending)

    def load_weights_from_disk(self, files: list[str], version: int | None) -> int:
        """Load the safetensors ``files`` (a policy folder's, of the served architecture;
        the control plane checked each path), recording the sync's report as for one
        received: what was read, and what was loaded. Returns the number of tensors
        loaded."""
        from ludic.distributed.weight_transfer.manifest import folder_tensors

        if self.ludic_checkpoint is None:
            self.ludic_checkpoint = checkpoint_shapes(self.model_runner.vllm_config.model_config)  # type: ignore[attr-defined]
        model = self.model_runner.model  # type: ignore[attr-defined]
        recorder = self._new_recorder()
        # the alias only where the served model has an output head tied to the embeddings
        tied = recorder.tied_embeddings and hasattr(model, "lm_head")
        loaded = 0
        # CPU: one load of everything (see the module docstring); CUDA: file by file
        batches = [files] if self._is_cpu() else [[file] for file in files]
        for batch in batches:
            named = {name: t for file in batch for name, t in folder_tensors(file)}
            check_adapter_names(named, adapter=False)
            recorder.receive(named)
            named = with_tied_alias(named, tied=tied)
            if self._is_cpu():
                with recorder.capturing():
                    self._load(named)
            else:
                self._load(named)
            loaded += len(named)
        self._finish_sync(recorder, version)
        return loaded

    def set_lora_adapter(self, adapter: dict[str, Any]) -> None:
        """Announce that the next sync carries a LoRA adapter (``ludic.inference.vllm.
        adapter``): ``{"name", "config" (peft's), "folder"}``; this worker writes it to
        ``folder/rank<rank>`` and loads it from there."""
        self.ludic_adapter_next = dict(adapter)

    def weight_report(self) -> dict[str, Any] | None:
        """The report of the last sync this worker loaded (``verify.make_report``): the
        sums of what it received and of what it loaded; ``None`` before the first."""
        return self.ludic_report

    def close_communicator(self) -> None:
        """Leave the group, or abandon a join still in progress (its thread closes the
        group if it forms later)."""
        self.ludic_pending, self.ludic_sync_failed = None, False
        if self.ludic_join is not None:
            join, self.ludic_join = self.ludic_join, None
            join.abandon()
        if self.ludic_receiver is not None:
            receiver, self.ludic_receiver = self.ludic_receiver, None
            receiver.close()

    # ------------------------------------------------------------------ internals
    def _joined_receiver(self) -> Any:
        """The group's receiver, waiting (bounded) for a join still in progress."""
        if self.ludic_receiver is None and self.ludic_join is not None:
            join, self.ludic_join = self.ludic_join, None
            self.ludic_receiver = join.result()
            logger.info("joined weight-sync group %s", join.where)
        if self.ludic_receiver is None:
            raise RuntimeError("no weight-sync group on this worker: POST /init_communicator first")
        return self.ludic_receiver

    def _new_recorder(self) -> LoadRecorder:
        hf_config = self.model_runner.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        tp_rank, tp_size = tensor_parallel_place()
        return LoadRecorder(
            self.model_runner.model,  # type: ignore[attr-defined]
            keep_tensors=self._is_cpu(),
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def _finish_sync(self, recorder: LoadRecorder, version: int | None) -> None:
        self.ludic_recorder = None
        started = time.perf_counter()
        self.ludic_report = recorder.report(version)
        self.ludic_report["seconds"] = recorder.seconds + time.perf_counter() - started

    def _load_adapter(
        self,
        adapter: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        recorder: LoadRecorder | None,
        version: int | None,
    ) -> None:
        folder = Path(adapter["folder"]) / f"rank{int(self.rank)}"  # type: ignore[attr-defined]
        self._write_adapter(folder, tensors, adapter["config"])
        load_adapter(self.model_runner, folder, adapter["name"])  # type: ignore[attr-defined]
        if recorder is None:
            return
        started = time.perf_counter()
        tp_rank, tp_size = tensor_parallel_place()
        self.ludic_recorder = None
        self.ludic_report = adapter_report(
            self.model_runner,  # type: ignore[attr-defined]
            tensors,
            recorder.received,
            adapter["config"],
            version=version,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.ludic_report["seconds"] = recorder.seconds + time.perf_counter() - started

    def _write_adapter(
        self, folder: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
    ) -> None:
        write_adapter(folder, tensors, config)

    def _is_cpu(self) -> bool:
        return torch.device(self.model_runner.device).type == "cpu"  # type: ignore[attr-defined]

    def _load(self, named: Mapping[str, torch.Tensor]) -> None:
        model = self.model_runner.model  # type: ignore[attr-defined]
        hf_config = self.model_runner.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        check_update(
            named,
            self.ludic_checkpoint,
            packed_modules=getattr(model, "packed_modules_mapping", {}) if self._is_cpu() else {},
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )
        if self.ludic_loader is None:
            self.ludic_loader = VLLMWeightLoader(self.model_runner)  # type: ignore[attr-defined]
        try:
            self.ludic_loader.load(named)
        except Exception as e:
            if self._is_cpu():
                restore_after_failed_reload(model)
            raise RuntimeError(
                f"loading the weight update failed ({type(e).__name__}: {e}); layers loaded "
                "before the failure hold the new weights, the others their previous ones. "
                "Publish the full model again."
            ) from e


class GroupJoin:
    """``make()`` (a blocking group join) running in a daemon thread.

    :meth:`result` waits for it (at most ``timeout_s`` more); :meth:`abandon` drops it, and
    a receiver that still forms afterwards is closed by the thread."""

    def __init__(self, make: Callable[[], Any], where: str, timeout_s: float) -> None:
        self.where = where
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._receiver: Any = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._thread = threading.Thread(
            target=self._run, args=(make,), name="ludic-group-join", daemon=True
        )
        self._thread.start()

    def _run(self, make: Callable[[], Any]) -> None:
        try:
            receiver = make()
        except BaseException as e:  # reported through status() / result()
            self._error = e
            self._done.set()
            return
        with self._lock:
            if self._abandoned:
                receiver.close()
            else:
                self._receiver = receiver
        self._done.set()

    def status(self) -> dict[str, Any]:
        if not self._done.is_set():
            return {"state": "joining", "error": None}
        if self._error is not None:
            return {"state": "failed", "error": f"{type(self._error).__name__}: {self._error}"}
        return {"state": "joined", "error": None}

    def result(self) -> Any:
        if not self._done.wait(self.timeout_s):
            raise TimeoutError(f"joining {self.where} did not finish within {self.timeout_s:.0f}s")
        if self._error is not None:
            raise RuntimeError(f"joining {self.where} failed: {self._error}") from self._error
        return self._receiver

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()


# ------------------------------------------------------------------------------ checks
TIED_HEAD = "lm_head.weight"
EMBEDDINGS_SUFFIX = "embed_tokens.weight"


def with_tied_alias(named: Mapping[str, torch.Tensor], *, tied: bool) -> dict[str, torch.Tensor]:
    """``named`` plus the tied ``lm_head.weight`` alias of the input embeddings when the
    model ties them and the tensors hold the embeddings without it, as a saved folder
    does (Hugging Face drops the alias). A trainer's sync carries it; vLLM skips it on
    load, but a CPU worker's layerwise reload leaves the output head on its previous
    values without it (measured: greedy tokens off after a disk load of a tied model)."""
    out = dict(named)
    if tied and TIED_HEAD not in out:
        embeddings = [name for name in out if name.endswith(EMBEDDINGS_SUFFIX)]
        if len(embeddings) == 1:
            out[TIED_HEAD] = out[embeddings[0]]
    return out


def check_adapter_names(named: Mapping[str, torch.Tensor], *, adapter: bool) -> None:
    """An announced adapter sync carries peft LoRA tensors only, any other sync none."""
    wrong = [n for n in named if is_lora_name(n) != adapter]
    if wrong:
        raise ValueError(
            f"tensor {wrong[0]!r} in a sync announced as an adapter sync (POST /lora_adapter)"
            if adapter
            else f"LoRA tensor {wrong[0]!r} in a full-weight sync: announce an adapter sync "
            "with POST /lora_adapter first (VLLMChatClient.set_lora_adapter)"
        )


def check_update(
    named: Mapping[str, torch.Tensor],
    checkpoint: Mapping[str, list[int]] | None,
    *,
    packed_modules: Mapping[str, list[str]],
    tied_embeddings: bool,
) -> None:
    """Raise ``ValueError`` (naming the tensor and the fix) unless every name is in the
    served checkpoint with its shape, and every fused layer of ``packed_modules`` (vLLM
    name -> HF parts) is either fully present or absent."""
    if checkpoint:
        for name, tensor in named.items():
            expected = checkpoint.get(name)
            if expected is None:
                if tied_embeddings and name.endswith("lm_head.weight"):
                    continue  # the tied alias of the embeddings; vLLM skips it
                raise ValueError(
                    f"weight update names {name!r}, which the served checkpoint does not have "
                    f"(e.g. {sorted(checkpoint)[:3]}); the trainer must publish the served "
                    "model's HF parameter names. Nothing was loaded."
                )
            if list(tensor.shape) != list(expected):
                raise ValueError(
                    f"weight update has {name!r} with shape {list(tensor.shape)}, the served "
                    f"model's is {list(expected)}; trainer and server must be the same "
                    "architecture. Nothing was loaded."
                )
    for parts in packed_modules.values():
        if len(parts) < 2:
            continue
        for name in named:
            prefix, leaf, suffix = _split_part(name, parts)
            if leaf is None:
                continue
            missing = [f"{prefix}{p}{suffix}" for p in parts if f"{prefix}{p}{suffix}" not in named]
            if missing:
                raise ValueError(
                    f"weight update has {name!r} but not {missing}: vLLM serves them as one "
                    "fused layer and on CPU reloads it only whole. Publish all of "
                    f"{parts} together. Nothing was loaded."
                )


def _split_part(name: str, parts: list[str]) -> tuple[str, str | None, str]:
    """``"a.b.q_proj.weight"`` -> ``("a.b.", "q_proj", ".weight")`` when the module leaf
    is one of ``parts``."""
    pieces = name.split(".")
    for i in range(len(pieces) - 1, -1, -1):
        if pieces[i] in parts:
            prefix = ".".join(pieces[:i])
            suffix = ".".join(pieces[i + 1 :])
            return (prefix + "." if prefix else ""), pieces[i], ("." + suffix if suffix else "")
    return "", None, ""


def checkpoint_shapes(model_config: Any) -> dict[str, list[int]] | None:
    """Tensor names -> shapes of the served safetensors checkpoint (headers only), or
    ``None`` when the files cannot be found (then names are not checked)."""
    files = _safetensors_files(str(model_config.model), getattr(model_config, "revision", None))
    if not files:
        logger.warning(
            "no safetensors files found for %s: weight names are not checked", model_config.model
        )
        return None
    shapes: dict[str, list[int]] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = [int(d) for d in meta["shape"]]
    return shapes


def _safetensors_files(model: str, revision: str | None) -> list[Path]:
    if os.path.isdir(model):
        return sorted(Path(model).glob("*.safetensors"))
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            model, revision=revision, allow_patterns=["*.safetensors"], local_files_only=True
        )
    except Exception:
        return []
    return sorted(Path(local).glob("*.safetensors"))


def tensor_parallel_place() -> tuple[int, int]:
    """This worker's (rank, size) in vLLM's tensor-parallel group; (0, 1) outside one."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:  # no vLLM parallel state (e.g. a unit test's fake worker)
        return 0, 1


def restore_after_failed_reload(model: torch.nn.Module) -> None:
    """Undo an interrupted layerwise reload (vLLM 0.32 internals): put every layer still
    waiting for weights back on its previous kernel tensors. Best effort."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise

        for layer in model.modules():
            info = layerwise.get_layerwise_info(layer)
            if info.can_load() and info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
                info.reset()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
    except Exception:
        logger.exception("could not restore the model after a failed weight reload")
