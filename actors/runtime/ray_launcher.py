"""``serve --launcher ray``: the pipeline's actors placed on a Ray cluster the user
already runs, with the same ZMQ messages between them.

Each actor role gets a small Ray actor, its shell, which Ray places by the resources it
asks for: one GPU for a worker on CUDA (``--ray-worker-cpus`` CPUs on the CPU), and
``--ray-actor-cpus`` CPUs for every other actor. The shell names its node's address
and starts the actor's process there exactly as the local launcher starts one here
(``python -m actorlm.actors.runtime.child ROLE``, its spec on stdin); it returns the
exit code when that process ends, and Ray raises when the shell or its node dies.
Either is a death to the launcher, so restarts, liveness and the shutdown go the local
launcher's way (``supervisor.py``). A restarted actor stays on its node, so its
address stays the same. The gateway stays on this host: it binds the HTTP port the
user named.

Every socket is tcp on the nodes' addresses; beyond loopback that needs ``--keys-dir``
(CurveZMQ keys from ``actorlm keys``), as any tcp deployment does. Ray itself is an
optional dependency (``pip install 'actorlm[ray]'``) imported only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
from typing import Any

import msgspec

from ...config import EngineConfig
from .child import ChildSpec
from .supervisor import GATEWAY, Launcher, StartupError, _Member
from .transport import free_port

__all__ = ["RAY_MISSING", "RayLauncher", "import_ray", "make_launcher"]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


RAY_MISSING = "--launcher ray needs Ray on this host and the cluster: pip install 'actorlm[ray]'"


def import_ray() -> Any:
    """The ``ray`` module (``validate_config`` has refused ``--launcher ray`` without it)."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(RAY_MISSING) from exc
    return ray


class _Shell:
    """One actor's process on the node Ray placed this shell on."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def address(self, host: str) -> str:
        """A free tcp address on ``host``, one of this node's addresses."""
        return f"tcp://{host}:{free_port(host)}"

    def run(self, role: str, child: bytes) -> int:
        """Start the actor (its parent: this shell) and return its exit code."""
        spec = msgspec.msgpack.decode(child, type=ChildSpec)
        spec = msgspec.structs.replace(spec, parent=os.getpid())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actorlm.actors.runtime.child", role], stdin=subprocess.PIPE
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.msgpack.encode(spec))
        self.proc.stdin.close()
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


class RayLauncher(Launcher):
    """``Launcher`` with every member but the gateway in a Ray actor's process."""

    def __init__(self, config: EngineConfig, roles: list[str] | dict[str, str]) -> None:
        self.ray = import_ray()
        deploy = config.deploy
        if not self.ray.is_initialized():
            # ray.init installs its own SIGTERM/SIGINT handlers (they end the process):
            # serve's own handlers (a drain, then a clean stop) are put back after
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            self.ray.init(
                address=deploy.ray_address, logging_level=logging.WARNING, log_to_driver=False
            )
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        # Loopback between actors on this host's node; a node's own address (Ray's) for
        # the others, and for this host's ends when the cluster has other nodes.
        self._node = str(self.ray.get_runtime_context().get_node_id())
        self._hosts = self._node_hosts()
        host = LOOPBACK if len(self._hosts) == 1 else self.ray.util.get_node_ip_address()
        here = {role: f"tcp://{host}:{free_port(host)}" for role in ("supervisor", GATEWAY)}
        config = msgspec.structs.replace(
            config, deploy=msgspec.structs.replace(deploy, transport="tcp")
        )
        super().__init__(config, roles, addresses=here)
        self._shells: dict[str, Any] = {}  # role → its shell's actor handle
        self._nodes: dict[str, str] = {}  # role → the node id its shell landed on

    def _shell(self, role: str, node: str = "") -> Any:
        """A new shell for ``role`` with its resources, on ``node`` if given."""
        ray, deploy = self.ray, self.config.deploy
        options: dict[str, Any] = {"max_concurrency": 2, "num_cpus": deploy.ray_actor_cpus}
        if role.split(".")[0] == "worker" and self.config.model.device == "cuda":
            options.update(num_cpus=0, num_gpus=1)
        elif role.split(".")[0] == "worker":
            options["num_cpus"] = deploy.ray_worker_cpus
        if node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        return ray.remote(**options)(_Shell).remote()

    async def start(self, timeout: float | None = None) -> None:
        roles = [r for r in self.members if r != GATEWAY]
        for role in roles:
            self._shells[role] = self._shell(role)
        wait = timeout or self.config.deploy.start_timeout_s
        try:
            nodes = await asyncio.wait_for(
                asyncio.gather(*(self._shells[r].node.remote() for r in roles)), wait
            )
        except TimeoutError:
            await self.stop()
            raise StartupError(
                f"Ray placed no shell for {', '.join(roles)} within {wait:g}s: does the "
                "cluster have the CPUs (or GPUs) they ask for?"
            ) from None
        if not set(nodes) <= set(self._hosts):  # a node joined since
            self._hosts = self._node_hosts()
        hosts = [self._hosts[n] for n in nodes]
        addresses = await asyncio.gather(
            *(self._shells[r].address.remote(h) for r, h in zip(roles, hosts, strict=True))
        )
        for role, node, address in zip(roles, nodes, addresses, strict=True):
            self.members[role].address = self.book[role] = address
            self._nodes[role] = node
        self._supervisor.book.update(self.book)
        await super().start(timeout)

    def _node_hosts(self) -> dict[str, str]:
        """Each live node's address for actorlm's sockets (loopback on this host's)."""
        hosts = {n["NodeID"]: n["NodeManagerAddress"] for n in self.ray.nodes() if n["Alive"]}
        return {**hosts, self._node: LOOPBACK}

    def _spawn(self, member: _Member) -> None:
        shell = self._shells.get(member.role)
        if shell is None:  # the gateway: a process on this host
            super()._spawn(member)
            return
        member.ready = asyncio.Event()
        member.alive = False
        member.ready_at = 0.0
        child = self._child_spec(member, 0)  # its parent: the shell, set there
        ref = shell.run.remote(member.role, msgspec.msgpack.encode(child))
        member.task = asyncio.create_task(self._exit_code(member.role, ref), name=member.role)
        member.task.add_done_callback(functools.partial(self._on_exit, member))

    async def _exit_code(self, role: str, ref: Any) -> None:
        try:
            code = await ref
        except self.ray.exceptions.RayActorError:
            if not self._stopping:  # the shell (or its node) died: a new one, same node
                self._shells[role] = self._shell(role, self._nodes[role])
            raise
        if code != 0:
            raise RuntimeError(f"its process exited with code {code}")

    def _kill(self, member: _Member) -> bool:
        shell = self._shells.get(member.role)
        if shell is None:
            return super()._kill(member)
        shell.kill.remote()
        return True

    async def _reap(self, member: _Member, deadline: float) -> None:
        await super()._reap(member, deadline)
        shell = self._shells.pop(member.role, None)
        if shell is not None:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(shell)  # and with it the actor's process, if it still ran

    async def stop(self, timeout: float = 5.0) -> None:
        await super().stop(timeout)
        for shell in self._shells.values():  # any _reap did not reach
            with contextlib.suppress(Exception):
                self.ray.kill(shell)
        self._shells.clear()


def make_launcher(config: EngineConfig, roles: list[str]) -> Launcher:
    """The launcher ``--launcher`` names for ``roles``."""
    if config.deploy.launcher == "ray":
        return RayLauncher(config, roles)
    return Launcher(config, roles)
