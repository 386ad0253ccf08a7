"""The loopback guard (issue 22, item 7): no server a test starts listens beyond loopback.

While a test's body runs (every :data:`SAMPLE_S`, in a thread) and once more when it ends
(its fixtures still up), the TCP sockets listening in the test process and in every
process below it are checked: one bound outside 127.0.0.0/8 and ::1 (``0.0.0.0`` and
``::`` included; ``::ffff:127.x`` is loopback) fails the test, naming the process and
the address. Servers held by fixtures (the session's vLLM server, the simulated Ray
cluster) are checked in every test that runs while they are up.

A check lists this process's descendants and their sockets (``/proc/PID/fd``, about 1 ms)
and, when they hold any, reads ``/proc/net/tcp`` and ``/proc/net/tcp6`` (this network
namespace's TCP sockets, about 7 ms: the kernel walks its whole socket hash) to see which
of them listen where. Linux only (no ``/proc/net/tcp``: no check).

:data:`EXEMPT`: listeners known to bind every interface whatever they are told, each
named with the reason; nothing else is let through.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass

import psutil

SAMPLE_S = 2.0
"""How often a running test is sampled (a server started and stopped within one test
body is seen if it listens for longer than this)."""

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"  # the TCP state column of /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    """A socket listening beyond loopback, and the process holding it."""

    pid: int
    name: str
    address: str
    port: int
    cmdline: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name}) listens on {self.address}:{self.port}: {self.cmdline}"


EXEMPT: dict[str, str] = {
    "pt_elastic": (
        "torchrun's elastic agent (trainer.world_size > 1, tests/distributed): the c10d "
        "TCPStore it hosts for the rendezvous listens on every interface whatever host it is "
        "given (--standalone asks for localhost), and torchrun has no option to hand it a "
        "socket bound to loopback as ludic's own weight-sync store does "
        "(ludic.distributed.weight_transfer.groups)"
    ),
}
"""Process names (``/proc/PID/comm``) whose non-loopback listeners are let through, each
with the reason it cannot be made to bind to loopback."""


def beyond_loopback() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every TCP socket listening beyond loopback in
    this network namespace."""
    found: dict[int, tuple[str, int]] = {}
    for table in TCP_TABLES:
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != LISTEN:
                continue
            hex_ip, hex_port = fields[1].split(":")
            ip = _address(hex_ip)
            if not _loopback(ip):
                found[int(fields[9])] = (str(ip), int(hex_port, 16))
    return found


def listeners_beyond_loopback() -> list[Listener]:
    """The non-loopback listeners of this process and its descendants (exempt ones left
    out)."""
    me = psutil.Process()
    try:
        procs = [me, *me.children(recursive=True)]
    except psutil.Error:
        procs = [me]
    held = {proc: _socket_inodes(proc.pid) for proc in procs}
    if not any(held.values()):
        return []
    sockets = beyond_loopback()
    found = []
    for proc, inodes in held.items():
        for inode in inodes & sockets.keys():
            try:
                name, cmdline = proc.name(), " ".join(proc.cmdline())[:200]
            except psutil.Error:
                continue
            if name not in EXEMPT:
                found.append(Listener(proc.pid, name, *sockets[inode], cmdline))
    return found


class Sampler:
    """Checks every :data:`SAMPLE_S` in a daemon thread until :meth:`stop`, which checks
    once more and returns every listener seen."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, str, int], Listener] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loopback-guard", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._check()

    def _check(self) -> None:
        for found in listeners_beyond_loopback():
            self.seen.setdefault((found.pid, found.address, found.port), found)

    def stop(self) -> list[Listener]:
        self._stop.set()
        self._thread.join()
        self._check()
        return list(self.seen.values())


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} write it: 32-bit words in host (little-endian)
    order."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes
