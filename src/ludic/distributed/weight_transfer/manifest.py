"""A policy folder's weight manifest: the checksum of every tensor in its safetensors
files, written next to them when ludic saves the folder.

A server told to load a folder from disk (``POST /load_weights_from_disk``) reports the
checksums of what it read and of what it loaded, as for a sync; the trainer checks that
report against the manifest (:func:`expected_checksums`), so the check covers the disk too:
a file torn by a crash or a copy, or edited since, fails it like a sync that arrived
changed. The checksum is :mod:`ludic.distributed.weight_transfer.verify`'s. A folder
ludic did not write (no manifest) is checked against its files as they are now.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ludic.distributed.weight_transfer.verify import SentChecksums

__all__ = [
    "MANIFEST",
    "expected_checksums",
    "folder_checksums",
    "folder_tensors",
    "read_manifest",
    "safetensors_files",
    "write_manifest",
]

MANIFEST = "ludic_checksums.json"
"""The manifest's file name inside the policy folder."""

FORMAT = 1


def safetensors_files(folder: str | Path) -> list[Path]:
    """The folder's ``*.safetensors`` files, sorted; ``FileNotFoundError`` when it has none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder}: no *.safetensors file (a Hugging Face folder saved with "
            "safe_serialization, e.g. RUN_DIR/policy)"
        )
    return files


def folder_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in ``path`` (a folder's safetensors files, or one
    file), read on the CPU one at a time."""
    from safetensors import safe_open

    files = [Path(path)] if Path(path).is_file() else safetensors_files(path)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def folder_checksums(folder: str | Path) -> SentChecksums:
    """The checksum of every tensor of the folder's safetensors files, as they are now."""
    sums = SentChecksums()
    for name, tensor in folder_tensors(folder):
        sums.record([name], [tensor])
    return sums


def write_manifest(folder: str | Path) -> Path:
    """Write ``folder/ludic_checksums.json`` from the folder's files (read right after
    they were written, before the folder is published)."""
    sums = folder_checksums(folder)
    path = Path(folder) / MANIFEST
    body = {"format": FORMAT, "checksums": {k: list(v) for k, v in sums.checksums.items()}}
    path.write_text(json.dumps(body, sort_keys=True))
    return path


def read_manifest(folder: str | Path) -> SentChecksums:
    """The checksums ``folder``'s manifest records; ``ValueError`` naming the file when it
    is not one."""
    path = Path(folder) / MANIFEST
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT:
            raise ValueError(f"format {body.get('format')!r}, expected {FORMAT}")
        sums = SentChecksums()
        sums.checksums = {
            str(name): tuple(int(v) for v in value) for name, value in body["checksums"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a ludic weight manifest ({e})") from None
    return sums


def expected_checksums(folder: str | Path) -> SentChecksums:
    """What a server loading ``folder`` must report: its manifest when it has one, else
    the checksums of its files now."""
    if (Path(folder) / MANIFEST).is_file():
        return read_manifest(folder)
    return folder_checksums(folder)
