"""Join files (``ludic.inference.vllm.joins``): what ``ludic serve policy --join`` writes
and a pool reads; a torn or foreign file is skipped, never half-read."""

from __future__ import annotations

from ludic.inference.vllm.joins import read_join_files, serving_url, write_join_file


def test_join_files_round_trip_and_torn_ones_are_skipped(tmp_path):
    write_join_file(tmp_path, "http://127.0.0.1:8001")
    write_join_file(tmp_path, "http://[::1]:8002/")
    (tmp_path / "torn.json").write_text('{"url": "http://127.0.0.1:80')  # cut mid-write
    (tmp_path / "other.json").write_text('{"url": "file:///etc/passwd"}')
    (tmp_path / "list.json").write_text("[1, 2]")
    assert sorted(read_join_files(tmp_path)) == ["http://127.0.0.1:8001", "http://[::1]:8002"]
    assert read_join_files(tmp_path / "missing") == {}
    assert not list(tmp_path.glob("*.tmp*"))  # written whole, then renamed


def test_the_url_comes_from_the_server_arguments():
    assert serving_url([]) == "http://127.0.0.1:8000"
    assert serving_url(["--port", "9001", "--host", "::1"]) == "http://[::1]:9001"
    assert serving_url(["--port=9002"]) == "http://127.0.0.1:9002"
