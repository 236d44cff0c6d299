"""Engine servers as child processes for bench/serving.py: each in its own process
group (so its workers go with it), its output to a log file, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

__all__ = ["EngineProcess", "actor_cpu_seconds", "free_port"]

_CHILD = b"actorlm.actors.runtime.child"


def free_port(host: str, start: int) -> int:
    for port in range(start, start + 200):
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port from {start}")


def actor_cpu_seconds(server: int) -> dict[str, float]:
    """CPU time (user + system, seconds) so far of an ``actorlm serve`` process (as
    "serve": its launcher) and of each actor process it started, by role."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        if int(entry.name) == server:
            out["serve"] = seconds
        elif int(fields[1]) == server and _CHILD in argv:
            out[argv[argv.index(_CHILD) + 1].decode()] = seconds
    return out


class EngineProcess:
    """A server started in its own process group, always stopped on exit."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._fh = open(log, "w")  # noqa: SIM115 - closed in stop()
        self._fh.write("$ " + " ".join(argv) + "\n")
        self._fh.flush()
        self.proc = subprocess.Popen(
            argv,
            env={**env, **os.environ},  # the engine's defaults; the caller's environment wins
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # Children that outlived the leader (e.g. engine workers) share its group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._fh.close()

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
