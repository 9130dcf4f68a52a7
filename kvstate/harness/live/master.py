"""The Mooncake master as a subprocess we start, wait for, and stop.

:class:`MooncakeMaster` starts ``mooncake_master`` with its HTTP metadata
server on free loopback ports, waits until both the metadata server and the
RPC port accept connections, and stops it on exit: also on Ctrl-C and on
errors, because it is a context manager. :func:`existing_master` describes a
master someone else runs, after checking that it answers.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO
from urllib.parse import urlparse

import attrs

from kvstate.harness.vllm_engine.watchdog import Stall, cpu_ticks


class MasterError(RuntimeError):
    """The master could not be started or reached."""


@attrs.frozen
class MasterAddress:
    """Where clients find a master: its metadata URL and its RPC address."""

    metadata_url: str
    rpc_address: str


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: each socket is held until all are chosen (a
    port closed at once may be handed out again, and a master given one port
    twice never starts)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
    except OSError:
        return False
    return True


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when its parent dies.

    Context managers and signal handlers stop the master on every exit that
    runs Python code; SIGKILL of the parent runs none, and without this the
    master would keep its ports and memory forever. None where ``prctl`` is
    not available (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


_PR_SET_PDEATHSIG = 1


def find_executable() -> str | None:
    """``mooncake_master`` next to this Python (a virtual environment), or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mooncake_master")


class MooncakeMaster:
    """A local master on free loopback ports, for one run or one test session."""

    def __init__(
        self,
        executable: str | None = None,
        *,
        stall_s: float = 30.0,
        log_path: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.executable = executable or find_executable()
        #: how long the master may stand still (no CPU used, no answer) while it starts
        self.stall_s = stall_s
        self.log_path = log_path
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        self.address: MasterAddress | None = None

    def start(self) -> MasterAddress:
        if self.executable is None:
            raise MasterError(
                "mooncake_master not found: install the 'mooncake' extra "
                "(mooncake-transfer-engine-non-cuda)"
            )
        metadata, rpc, metrics = free_ports(3)
        log: int | IO[bytes] = subprocess.DEVNULL
        if self.log_path:
            log = open(self.log_path, "ab")  # noqa: SIM115 - closed below, once the child has it
        try:
            self.process = subprocess.Popen(
                [
                    self.executable,
                    "--enable_http_metadata_server=true",
                    f"--http_metadata_server_port={metadata}",
                    f"--rpc_port={rpc}",
                    f"--metrics_port={metrics}",
                    *self.extra_args,
                ],
                stdout=log,
                stderr=log,
                start_new_session=True,  # Ctrl-C reaches us, and we stop it ourselves
                preexec_fn=_die_with_parent(),  # runs prctl only: safe beside threads
            )
        finally:
            if not isinstance(log, int):
                log.close()
        # Watched by its progress, not a deadline: on a loaded machine the
        # master starts slowly but uses CPU; one that stands still never will.
        process = self.process
        stall = Stall(self.stall_s, cpu_ticks(process.pid), time.monotonic())
        while not (_answers("127.0.0.1", metadata) and _answers("127.0.0.1", rpc)):
            if process.poll() is not None:
                raise MasterError(f"mooncake_master exited with status {process.returncode}")
            if stall.stalled(cpu_ticks(process.pid), time.monotonic()):
                self.stop()
                raise MasterError(
                    f"mooncake_master did not answer and used no CPU for {self.stall_s:g} s"
                )
            time.sleep(0.05)
        self.address = MasterAddress(f"http://127.0.0.1:{metadata}/metadata", f"127.0.0.1:{rpc}")
        return self.address

    def stop(self) -> None:
        """Stop the master (SIGTERM, then SIGKILL after 5 s); idempotent."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> MasterAddress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def existing_master(metadata_url: str, rpc_address: str) -> MasterAddress:
    """A master run elsewhere; raises :class:`MasterError` unless both ends answer.

    (A client set up against a master that does not answer blocks for about
    90 s before it fails, so check first.)
    """
    meta = urlparse(metadata_url)
    host, _, port = rpc_address.rpartition(":")
    if not (meta.hostname and meta.port and _answers(meta.hostname, meta.port)):
        raise MasterError(f"no metadata server answers at {metadata_url}")
    if not (host and port.isdigit() and _answers(host, int(port))):
        raise MasterError(f"no master answers at {rpc_address}")
    return MasterAddress(metadata_url, rpc_address)
