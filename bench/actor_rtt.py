"""Actor round trip, its CPU, and throughput beside raw pyzmq + msgpack, over unix, ipc
and tcp.

Two processes each way. The actor path uses the real Launcher (one actor
process) and an ActorRuntime client in this process, on uvloop; the raw path is
a blocking PUSH/PULL pair per direction with msgpack, the same envelope and
body sizes (over ipc where the actors use unix: raw ZMQ has no unix transport).
Latency: request → reply, p50/p99, and the CPU time of both processes (all their
threads, ZMQ's I/O threads included) a round trip. Throughput: one-way messages/s
(the last one is a request, answered once the receiver has seen them all).

Both paths stay up for the whole run and are measured in alternating rounds
(``--rounds``: latency rounds, then throughput rounds; which path goes first
alternates), so a load change on a shared machine hits both alike instead of
skewing the ratio; ``--rounds 1`` measures each path in one go.

    python bench/actor_rtt.py --iters 5000 --msgs 50000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import zmq
from actorlm.actors.runtime import Actor, ActorRuntime, RuntimeOptions, handles
from actorlm.actors.runtime.process import event_loop_runner
from actorlm.actors.runtime.supervisor import Launcher
from actorlm.config import DeployConfig, EngineConfig
from actorlm.messages.base import Message
from actorlm.messages.control import Ack, Ping, Pong
from actorlm.messages.envelope import Envelope

# The actor process imports this file by name: "actor_rtt" when run as a script.
_MODULE = (
    __spec__.name if __spec__ is not None and __spec__.name != "__main__" else Path(__file__).stem
)


class Tick(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "bench.tick"
    i: int
    payload: bytes = b""


class BenchEcho(Actor):
    role = "echo"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.seen = 0

    @handles(Ping)
    async def on_ping(self, msg: Ping, env: Envelope) -> Pong:
        return Pong(payload=msg.payload)

    @handles(Tick)
    async def on_tick(self, msg: Tick, env: Envelope) -> Ack:
        self.seen += 1
        return Ack(detail=str(self.seen))


class BenchClient(Actor):
    role = "bench-client"


def percentiles(samples_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) / 1e3, p99 / 1e3


# -- the actor path ------------------------------------------------------------------
class ActorPath:
    """The echo actor in its own process (started by the Launcher), asked by a client
    runtime on this loop."""

    def __init__(self, transport: str, payload: bytes) -> None:
        # The launcher shares this loop with the sending client: a burst of sends must not
        # look like a hung actor to its heartbeat watch.
        deploy = DeployConfig(transport=transport, heartbeat_s=1.0, peer_timeout_s=60.0)  # type: ignore[arg-type]
        self.config = EngineConfig(deploy=deploy)
        self.launcher = Launcher(self.config, {"echo": f"{_MODULE}:BenchEcho"})
        self.payload = payload
        self.ticks = 0  # Ticks the echo actor has seen

    async def start(self, warmup: int) -> None:
        await self.launcher.start(timeout=60)
        address = self.launcher.new_address("bench-client")
        self.client = ActorRuntime(
            BenchClient(self.config), address, self.launcher.transport, RuntimeOptions()
        )
        self.launcher.attach(self.client)
        self.serving = asyncio.create_task(self.client.serve())
        await self.client.ready.wait()
        await self.latency(warmup)
        await self.client.request("echo", Tick(i=-1, payload=self.payload))  # warm the Tick path
        self.ticks += 1

    def peer_pid(self) -> int:
        return self.launcher.members["echo"].pid

    async def latency(self, iters: int) -> list[int]:
        ping, request, clock = Ping(payload=self.payload), self.client.request, time.perf_counter_ns
        samples = []
        for _ in range(iters):
            t0 = clock()
            await request("echo", ping)
            samples.append(clock() - t0)
        return samples

    async def throughput(self, msgs: int) -> float:
        """Seconds to send ``msgs`` one-way and hear that the last one arrived."""
        payload = self.payload
        t0 = time.perf_counter()
        for i in range(msgs - 1):
            await self.client.send("echo", Tick(i=i, payload=payload))
        last = await self.client.request("echo", Tick(i=msgs - 1, payload=payload), timeout=120)
        elapsed = time.perf_counter() - t0
        self.ticks += msgs
        assert isinstance(last, Ack) and int(last.detail) == self.ticks, last
        return elapsed

    async def stop(self) -> None:
        self.client.stop()
        await self.serving
        await self.launcher.stop()


# -- the raw path ---------------------------------------------------------------------
def _raw_server(inbox: str, outbox: str) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(inbox)
    push = ctx.socket(zmq.PUSH)
    push.connect(outbox)
    seen = 0
    while True:
        env_frame, body_frame = pull.recv_multipart()
        env = msgpack.unpackb(env_frame)
        body = msgpack.unpackb(body_frame)
        if env[0] == "stop":
            break
        if env[0] == "bench.tick":
            seen += 1
            if env[3] != 1:  # a one-way send: no reply
                continue
            body = {"ok": True, "detail": str(seen)}
        reply = msgpack.packb(["reply", env[1], "echo", 2, env[1], inbox])
        push.send_multipart([reply, msgpack.packb(body)])
    pull.close(0)
    push.close(0)
    ctx.term()


class RawPath:
    """A blocking msgpack echo server in its own process, asked with blocking calls."""

    def __init__(self, transport: str, payload: bytes) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="actorlm-rtt-")
        if transport in ("unix", "ipc"):
            server_addr = f"ipc://{self.tmp.name}/server.sock"
            client_addr = f"ipc://{self.tmp.name}/client.sock"
        else:
            server_addr, client_addr = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(client_addr)
        self.client_addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        if transport == "tcp":
            with zmq.Context().socket(zmq.PULL) as probe:  # pick a free port for the server
                probe.bind(server_addr)
                server_addr = probe.getsockopt_string(zmq.LAST_ENDPOINT)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_raw_server, args=(server_addr, self.client_addr)
        )
        self.proc.start()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(server_addr)
        self.ids = iter(range(1, 1 << 62))
        self.payload = payload
        self.ticks = 0

    def call(self, tag: str, body: dict[str, Any], kind: int = 1) -> Any:
        self.push.send_multipart(
            [
                msgpack.packb([tag, next(self.ids), "client", kind, 0, self.client_addr]),
                msgpack.packb(body),
            ]
        )
        if kind != 1:
            return None
        env_frame, body_frame = self.pull.recv_multipart()
        msgpack.unpackb(env_frame)
        return msgpack.unpackb(body_frame)

    def start(self, warmup: int) -> None:
        self.latency(warmup)

    def peer_pid(self) -> int:
        return self.proc.pid or 0

    def latency(self, iters: int) -> list[int]:
        ping, call, clock = {"payload": self.payload}, self.call, time.perf_counter_ns
        samples = []
        for _ in range(iters):
            t0 = clock()
            call("ctl.ping", ping)
            samples.append(clock() - t0)
        return samples

    def throughput(self, msgs: int) -> float:
        payload = self.payload
        t0 = time.perf_counter()
        for i in range(msgs - 1):
            self.call("bench.tick", {"i": i, "payload": payload}, kind=0)
        last = self.call("bench.tick", {"i": msgs - 1, "payload": payload})
        elapsed = time.perf_counter() - t0
        self.ticks += msgs
        assert int(last["detail"]) == self.ticks, last
        return elapsed

    def stop(self) -> None:
        self.push.send_multipart(
            [msgpack.packb(["stop", 0, "client", 0, 0, ""]), msgpack.packb({})]
        )
        self.proc.join(10)
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()
        self.tmp.cleanup()


def cpu_seconds(peer: int) -> float:
    """CPU time (user + system) so far of this process and of process ``peer``."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    fields = Path(f"/proc/{peer}/stat").read_text().rsplit(")", 1)[1].split()
    return (
        own.ru_utime + own.ru_stime + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    )


def summary(samples_ns: list[int], cpu_s: float, msgs: int, seconds: float) -> dict[str, Any]:
    p50, p99 = percentiles(samples_ns)
    cpu_us = cpu_s / len(samples_ns) * 1e6
    return {"p50_us": p50, "p99_us": p99, "cpu_us": cpu_us, "msgs_per_s": msgs / seconds}


async def compare(
    transport: str, payload: bytes, iters: int, msgs: int, warmup: int, rounds: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both paths up at once, measured in alternating rounds: (raw, actor). All latency
    rounds come first, so none follows a throughput burst still being cleaned up; the
    path that goes first alternates from round to round."""
    raw, actor = RawPath(transport, payload), ActorPath(transport, payload)
    samples: dict[str, list[int]] = {"raw": [], "actor": []}
    seconds = {"raw": 0.0, "actor": 0.0}
    cpu = {"raw": 0.0, "actor": 0.0}

    async def latency(path: str, n: int) -> None:
        # The raw path blocks this loop; the actor path is idle meanwhile.
        peer = raw.peer_pid() if path == "raw" else actor.peer_pid()
        before = cpu_seconds(peer)
        samples[path] += raw.latency(n) if path == "raw" else await actor.latency(n)
        cpu[path] += cpu_seconds(peer) - before

    async def throughput(path: str, m: int) -> None:
        seconds[path] += raw.throughput(m) if path == "raw" else await actor.throughput(m)

    try:
        raw.start(warmup)
        await actor.start(warmup)
        for measure, total in ((latency, iters), (throughput, msgs)):
            for r in range(rounds):
                share = total // rounds + (r < total % rounds)
                for path in ("raw", "actor") if r % 2 == 0 else ("actor", "raw"):
                    await measure(path, share)
    finally:
        raw.stop()
        await actor.stop()
    return (
        summary(samples["raw"], cpu["raw"], msgs, seconds["raw"]),
        summary(samples["actor"], cpu["actor"], msgs, seconds["actor"]),
    )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| transport | path | rtt p50 µs | rtt p99 µs | CPU µs a round trip | one-way msg/s"
        " | rtt p50 ÷ raw | raw msg/s ÷ msg/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['transport']} | {r['path']} | {r['p50_us']:.1f} | {r['p99_us']:.1f}"
            f" | {r['cpu_us']:.1f} | {r['msgs_per_s']:,.0f}"
            f" | {r.get('rtt_ratio', 1.0):.2f}× | {r.get('tput_ratio', 1.0):.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=5000, help="timed round trips per path")
    parser.add_argument("--warmup", type=int, default=500, help="untimed round trips first")
    parser.add_argument("--msgs", type=int, default=50000, help="one-way messages for throughput")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes per message")
    parser.add_argument(
        "--transports", default="unix,ipc,tcp", help="comma-separated: unix,ipc,tcp"
    )
    parser.add_argument(
        "--rounds", type=int, default=10, help="alternating raw/actor rounds per transport"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "actor_rtt.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.iters < args.rounds or args.msgs < 2 * args.rounds:
        parser.error("need --rounds >= 1, --iters >= rounds and --msgs >= 2 * rounds")
    payload = b"x" * args.payload
    rows: list[dict[str, Any]] = []
    run = event_loop_runner()
    for transport in args.transports.split(","):
        raw, actor = run(
            compare(transport, payload, args.iters, args.msgs, args.warmup, args.rounds)
        )
        actor["rtt_ratio"] = actor["p50_us"] / raw["p50_us"]
        actor["tput_ratio"] = raw["msgs_per_s"] / actor["msgs_per_s"]
        raw_path = "raw pyzmq+msgpack" + (" (ipc)" if transport == "unix" else "")
        rows += [
            {"transport": transport, "path": raw_path, **raw},
            {"transport": transport, "path": "actorlm", **actor},
        ]
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "iters": args.iters,
        "msgs": args.msgs,
        "payload": args.payload,
        "rounds": args.rounds,
        "python": sys.version.split()[0],
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nraw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
