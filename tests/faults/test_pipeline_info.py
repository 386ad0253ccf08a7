"""A torn or foreign RUN_DIR/pipeline.json is one clear error naming the file, and the
learner's writes are atomic (a reader never sees half a file)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ludic.pipeline.run_info import PIPELINE_INFO, wait_for_redis_url, write_pipeline_info
from ludic.run.errors import RunError


def test_written_info_reads_back(tmp_path: Path) -> None:
    write_pipeline_info(SimpleNamespace(path=tmp_path), "redis://127.0.0.1:7000/0", "run-1")
    assert wait_for_redis_url(tmp_path, timeout_s=1) == "redis://127.0.0.1:7000/0"
    assert [p.name for p in tmp_path.iterdir()] == [PIPELINE_INFO]  # no temporary left


@pytest.mark.parametrize("text", ['{"redis_url": "redis://127.0.0.1:70', '{"prefix": "x"}', "[]"])
def test_torn_or_foreign_info_names_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / PIPELINE_INFO).write_text(text)
    with pytest.raises(RunError, match=rf"{PIPELINE_INFO}: not a pipeline info file"):
        wait_for_redis_url(tmp_path, timeout_s=1)


def test_missing_info_times_out_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="start `ludic learner CONFIG` first"):
        wait_for_redis_url(tmp_path, timeout_s=0.3)
