"""A policy folder's weight manifest (``ludic_checksums.json``): it records the files as
saved; a torn or hand-edited manifest is refused naming the file, never taken as the
expected checksums; a folder ludic did not write is checked against its files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ludic.distributed.weight_transfer.manifest import (
    MANIFEST,
    expected_checksums,
    read_manifest,
    write_manifest,
)
from ludic.distributed.weight_transfer.verify import checksums


def _folder(tmp_path: Path) -> Path:
    tensors = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(5).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_the_manifest_records_each_saved_tensor(tmp_path: Path) -> None:
    from safetensors import safe_open

    folder = _folder(tmp_path)
    assert write_manifest(folder) == folder / MANIFEST
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        sums = checksums([f.get_tensor(n) for n in names])
    assert read_manifest(folder).checksums == dict(zip(names, sums))
    assert expected_checksums(folder).checksums == dict(zip(names, sums))


@pytest.mark.parametrize(
    "text",
    [
        '{"format": 1, "checksums": {"a.weight": [1, 2',  # torn mid-write
        '{"format": 2, "checksums": {}}',
        '{"format": 1, "checksums": {"a.weight": ["x"]}}',
        "[]",
    ],
)
def test_a_torn_or_foreign_manifest_is_refused_naming_the_file(tmp_path: Path, text: str):
    folder = _folder(tmp_path)
    (folder / MANIFEST).write_text(text)
    with pytest.raises(ValueError, match=r"ludic_checksums.json: not a ludic weight manifest"):
        expected_checksums(folder)


def test_a_folder_without_a_manifest_is_checked_against_its_files(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    write_manifest(folder)
    recorded = read_manifest(folder).checksums
    (folder / MANIFEST).unlink()
    assert expected_checksums(folder).checksums == recorded
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file"):
        expected_checksums(folder)
    with pytest.raises(FileNotFoundError, match=r"no such folder"):
        expected_checksums(tmp_path / "nowhere")
