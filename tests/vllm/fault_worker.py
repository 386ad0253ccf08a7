"""The session server's worker extension in the tests: ludic's own
(``WeightSyncWorkerExtension``) with one fault switch for the sync-verification tests.

Before each load the worker reads the file named by ``$LUDIC_TEST_LOAD_FAULT`` (absent or
empty: no fault, the production path unchanged). ``corrupt NAME`` adds 1.0 to one element
of tensor ``NAME`` on its way into the model; ``skip NAME`` leaves ``NAME`` out of the
load; ``permute NAME`` loads its rows in reverse order. Each is what a broken loader does
after the tensor arrived intact."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tests.vllm.helpers import FAULT_ENV

from ludic.inference.vllm.worker import WeightSyncWorkerExtension


class FaultInjectingWorker(WeightSyncWorkerExtension):
    def _load(self, named: Mapping[str, torch.Tensor]) -> None:
        super()._load(_with_fault(named))

    def _write_adapter(self, folder: Any, tensors: Mapping[str, torch.Tensor], config: Any) -> None:
        super()._write_adapter(folder, _with_fault(tensors), config)


def _with_fault(named: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    path = os.environ.get(FAULT_ENV)
    fault = Path(path).read_text().split() if path and Path(path).exists() else []
    if not fault:
        return named
    kind, name = fault
    named = dict(named)
    if kind == "corrupt":
        changed = named[name].clone()
        changed.view(-1)[7] += 1.0
        named[name] = changed
    elif kind == "skip":
        del named[name]
    elif kind == "permute":  # rows swapped: the same values, so the same sums
        named[name] = named[name].flip(0).contiguous()
    else:
        raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r}")
    return named
