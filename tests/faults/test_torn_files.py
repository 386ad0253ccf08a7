"""Issue 9, "4. Nothing lost on a crash": kill -9 during resume's metrics rewrite left an
85 MB metrics.jsonl at 0 bytes. A real process rewrites a real metrics file in a loop while
this test watches the file and kills the process with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ludic.jsonl import JSONLError, TornLineWarning, append_jsonl, read_jsonl, rewrite_jsonl

REWRITER = """
import sys
from ludic.run.run_dir import RunDirectory
run = RunDirectory(sys.argv[1])
open(sys.argv[2], "w").close()
while True:
    run.truncate_metrics("rl", 10**9)  # what --resume does; keeps every line here
"""


def test_kill_9_during_the_metrics_rewrite_leaves_the_whole_file(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    line = {"phase": "rl", "loss": 0.125, "pad": "x" * 150}
    original = "".join(json.dumps({**line, "step": i}) + "\n" for i in range(1, 40_001))
    metrics.write_text(original)  # ~8 MB
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", REWRITER, str(tmp_path), str(started)])
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "rewriter did not start"
            time.sleep(0.01)
        torn_seen = None
        watch_until = time.monotonic() + 2.0  # several rewrites
        while time.monotonic() < watch_until:
            size = os.stat(metrics).st_size
            if size != len(original):
                torn_seen = size
                break
        os.kill(proc.pid, signal.SIGKILL)  # at whatever point of a rewrite it is
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert torn_seen is None, f"metrics.jsonl was seen at {torn_seen} bytes during a rewrite"
    assert metrics.read_text() == original


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append_jsonl(path, {"step": 1})
    with path.open("a") as f:
        f.write('{"step": 2, "lo')
    with pytest.raises(JSONLError, match=rf"{path}:2: not valid JSON"):
        read_jsonl(path)
    with pytest.warns(TornLineWarning, match=rf"{path}:2: dropped a torn last line"):
        assert read_jsonl(path, tolerate_torn_tail=True) == [{"step": 1}]
    append_jsonl(path, {"step": 3})  # starts a new line instead of gluing onto the torn one
    with pytest.raises(JSONLError, match=rf"{path}:2: .*a line in the middle"):
        read_jsonl(path, tolerate_torn_tail=True)


def test_rewrite_jsonl_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    rewrite_jsonl(path, [{"a": 2}])
    assert read_jsonl(path) == [{"a": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]
