"""``model.path`` checks (:func:`ludic.run.models.check_model_path`): each way a path can
be wrong gets its own complete one-line reason, in milliseconds, before a run directory."""

from __future__ import annotations

import time

import pytest

from ludic.run.errors import RunError
from ludic.run.models import check_model_path, naming_load_errors


def _reason(path) -> str:
    with pytest.raises(RunError) as info:
        check_model_path("model.path", str(path))
    return str(info.value)


def test_a_file_is_reported_as_a_file_not_as_a_missing_folder(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    reason = _reason(tmp_path / "weights.bin")
    assert reason.startswith("model.path: ") and "is a file, not a folder" in reason
    assert "does not exist" not in reason


def test_a_missing_folder_is_reported_as_missing(tmp_path) -> None:
    assert (
        _reason(tmp_path / "gone")
        == f"model.path: folder {str(tmp_path / 'gone')!r} does not exist"
    )


def test_an_empty_folder_says_it_holds_no_config_json(tmp_path) -> None:
    reason = _reason(tmp_path)
    assert f"folder {str(tmp_path)!r} holds no config.json" in reason
    assert "from one of" not in reason and "\n" not in reason


def test_a_config_json_that_is_a_folder_says_so(tmp_path) -> None:
    (tmp_path / "config.json").mkdir()
    assert f"{str(tmp_path / 'config.json')!r} is a folder, not a file" in _reason(tmp_path)


def test_a_bare_name_is_neither_a_folder_nor_a_hub_id_and_fails_at_once(monkeypatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", "/nonexistent/hf-cache")
    started = time.monotonic()
    reason = _reason("nope")
    assert time.monotonic() - started < 1
    assert reason.startswith("model.path: folder 'nope' does not exist")
    assert "not a hub id of the form org/name" in reason


def test_an_uncached_hub_id_fails_at_once_when_downloads_are_off(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reason = _reason("Qwen/Qwen2.5-0.5B-Instruct")
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in reason
    monkeypatch.delenv("HF_HUB_OFFLINE")
    check_model_path("model.path", "Qwen/Qwen2.5-0.5B-Instruct")  # may download: passes


def test_a_cached_bare_name_is_a_hub_id(tmp_path, monkeypatch) -> None:
    """``gpt2``-style names predate org/name ids; they pass when the cache has them."""
    snapshot = tmp_path / "models--gpt2" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--gpt2" / "refs").mkdir()
    (tmp_path / "models--gpt2" / "refs" / "main").write_text("abc")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    check_model_path("model.path", "gpt2")


def test_a_load_error_keeps_its_whole_reason_on_one_line() -> None:
    lines = "Couldn't instantiate the backend tokenizer from one of: \n(1) a file, \n(2) a class"
    with pytest.raises(RunError) as info, naming_load_errors("model.path", "/m"):
        raise ValueError(lines)
    assert (
        "(ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a file, "
        "(2) a class)" in str(info.value)
    )
