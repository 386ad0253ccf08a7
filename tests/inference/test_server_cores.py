"""Pinning a ludic server to CPU cores (``cpu_cores`` / ``LUDIC_CPU_CORES``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ludic.inference.vllm.process import CPU_CORES_ENV, parse_cpu_cores


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("0", {0}),
        ("0-3", {0, 1, 2, 3}),
        ("0,2,5-6", {0, 2, 5, 6}),
        (" 1 , 3", {1, 3}),
        ("0|1-2", {0, 1, 2}),  # a tensor-parallel server's workers: all of their cores
    ],
)
def test_core_lists_parse(text: str, cores: set[int]) -> None:
    assert parse_cpu_cores(text) == cores


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1,,2", "1.5"])
def test_bad_core_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected a list like"):
        parse_cpu_cores(text)


def pinned_affinity(cores: str) -> subprocess.CompletedProcess[str]:
    code = (  # a thread started before the pinning, one after, and the main thread
        "import os, threading; from ludic.inference.vllm.process import pin_to_env_cores; "
        "stop = threading.Event(); early = threading.Thread(target=stop.wait, daemon=True); "
        "early.start(); "
        "pin_to_env_cores(); seen = []; "
        "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); "
        "t.start(); t.join(); print(sorted(os.sched_getaffinity(0)), sorted(seen[0]), "
        "sorted(os.sched_getaffinity(early.native_id))); stop.set()"
    )
    env = {**os.environ, CPU_CORES_ENV: cores}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_server_process_pins_itself_and_its_threads_inherit() -> None:
    last = (os.cpu_count() or 1) - 1
    done = pinned_affinity(str(last))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"[{last}]"] * 3


def test_cores_the_machine_lacks_fail_before_anything_starts() -> None:
    done = pinned_affinity(str(os.cpu_count() or 1))
    assert done.returncode != 0 and f"this machine has {os.cpu_count()} cores" in done.stderr


def test_start_vllm_server_refuses_a_bad_core_list_before_starting(tmp_path) -> None:
    from ludic.inference.vllm.process import start_vllm_server

    with pytest.raises(ValueError, match="expected a list like"):
        start_vllm_server(tmp_path, cpu_cores="0-", log_path=tmp_path / "log", wait=False)
    assert not (tmp_path / "log").exists()
