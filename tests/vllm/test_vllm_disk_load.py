"""Issue 27, item 4: ``POST /load_weights_from_disk`` on the session vLLM server (started
with ``--weight-load-roots ROOT/disk``). A policy folder ludic saved loads to parity and
is verified against its manifest like a sync against what was sent; a folder changed on
disk since it was saved fails that check, naming the tensor; a path outside the roots (by
``..``, by a symlinked folder or a symlinked file) is refused with 403 and changes
nothing; a bad body is a 400."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.vllm.helpers import perturb  # noqa: E402

from ludic.distributed.weight_transfer.manifest import MANIFEST, read_manifest  # noqa: E402
from ludic.distributed.weight_transfer.verify import SyncVerificationError  # noqa: E402
from ludic.inference.vllm.client import VLLMServerError  # noqa: E402
from ludic.run.export import save_policy_folder  # noqa: E402


def _saved(served, name: str, seed: int):
    """The mirror perturbed with ``seed``, saved as ludic saves a checkpoint's policy."""
    perturb(served.mirror, seed=seed)
    return save_policy_folder(served.mirror, served.tokenizer, served.root / "disk" / name)


def test_a_saved_policy_folder_loads_verified_to_parity(served):
    folder = _saved(served, "step_00000007/policy", seed=71)
    assert set(read_manifest(folder).checksums) >= {"model.embed_tokens.weight"}
    version = served.client.get_policy_version() + 5
    status = served.client.load_weights_from_disk(folder, version=version)
    assert "verified" in status
    assert served.client.get_policy_version() == version
    assert served.assert_parity().trace.policy_version == version
    report = served.client.control.weight_report()
    assert report["version"] == version and report["workers"][0]["received"]


def test_a_folder_changed_on_disk_since_it_was_saved_fails_verification(served, tmp_path):
    folder = _saved(served, "torn/policy", seed=72)
    manifest = (folder / MANIFEST).read_text()
    perturb(served.mirror, seed=73)  # another policy's files under the old manifest
    save_policy_folder(served.mirror, served.tokenizer, folder)
    (folder / MANIFEST).write_text(manifest)
    version = served.client.get_policy_version() + 1
    with pytest.raises(SyncVerificationError, match=r"tensor '.*' arrived changed"):
        served.client.load_weights_from_disk(folder, version=version)
    # the server holds the files' weights (what it read), and says so: nothing hidden
    served.assert_parity()


def test_paths_outside_the_roots_are_refused_and_change_nothing(served, tmp_path):
    outside = save_policy_folder(served.mirror, served.tokenizer, tmp_path / "policy")
    inside_link = served.root / "disk" / "link"
    if not inside_link.exists():
        os.symlink(outside, inside_link)
    linked_file = served.root / "disk" / "linked_file"  # a folder inside, its file outside
    if not linked_file.exists():
        linked_file.mkdir()
        os.symlink(outside / "model.safetensors", linked_file / "model.safetensors")
    version = served.client.get_policy_version()
    control = served.client.control
    for path in (outside, served.root / "disk" / ".." / "elsewhere", inside_link, linked_file):
        with pytest.raises(VLLMServerError, match=r"403.*--weight-load-roots"):
            control.post("/load_weights_from_disk", {"path": str(path), "version": 99})
    empty = served.root / "disk" / "empty"
    empty.mkdir(exist_ok=True)
    for body, match in (
        ({"path": str(empty)}, r"400.*no \*\.safetensors"),
        ({"path": 7}, r"400.*path"),
        ({"path": str(empty), "version": "x"}, r"400.*version"),
    ):
        with pytest.raises(VLLMServerError, match=match):
            control.post("/load_weights_from_disk", body)
    assert served.client.get_policy_version() == version
    served.assert_parity()
