"""A placed process's output survives a poll whose answer never reached the launcher (a
timeout, or a Ray restart between the call and its answer): lines are forgotten only once
a later poll acknowledges them, and a new incarnation sends everything it has."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading

from ludic.pipeline.ray_processes import MAX_KEPT_LINES, PlacedProcess


def _placed(lines: list[str]) -> PlacedProcess:
    """A PlacedProcess whose child printed ``lines`` (no Ray: the fields poll reads)."""
    placed = object.__new__(PlacedProcess)
    placed._lines = collections.deque(maxlen=MAX_KEPT_LINES)
    placed._next_line = 0
    placed._dropped = 0
    placed._lock = threading.Lock()
    placed.node_id, placed.node_ip, placed.url, placed.restarted = "n", "127.0.0.1", None, False
    placed.process = subprocess.Popen(
        [sys.executable, "-c", "print('\\n'.join(__import__('sys').argv[1:]))", *lines],
        stdout=subprocess.PIPE,
    )
    placed._keep_output(placed.process.stdout)
    placed.process.wait()
    return placed


def test_lines_are_sent_again_until_a_poll_acknowledges_them() -> None:
    placed = _placed(["joined", "step"])
    lost = placed.poll()  # its answer never reaches the launcher
    assert lost["lines"] == ["joined", "step"]
    again = placed.poll()  # nothing acknowledged yet: the same lines again
    assert again["lines"] == ["joined", "step"] and again["last_line"] == 1
    assert placed.poll(again["last_line"], again["actor_pid"])["lines"] == []


def test_an_acknowledgement_from_another_incarnation_sends_every_line() -> None:
    placed = _placed(["restarted", "joined"])
    answer = placed.poll(5, incarnation=os.getpid() + 1)  # counted in the killed incarnation
    assert answer["lines"] == ["restarted", "joined"]
