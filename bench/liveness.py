"""Liveness of a split deployment: each actor started alone (``actorlm actor ROLE
--deploy``) on its own loopback address, ``actorlm serve --deploy`` in front, and each
role killed with SIGKILL while a request streams, then started again.

    python bench/liveness.py                  # the embedded model, --peer-timeout-s 3
    python bench/liveness.py --model DIR --peer-timeout-s 1

Per role: when the in-flight stream ended with an error, when /health turned 503
naming the role, and how long until serving again once the role was started again
(its model load included). Prints the table and writes the raw results to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from actorlm.actors.runtime.keys import create_keys  # noqa: E402
from actorlm.actors.runtime.transport import free_port  # noqa: E402

__all__ = ["main"]

ROLES = ("worker", "cache_manager", "scheduler", "tokenizer")


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def _stream(url: str, out: dict[str, float], started: threading.Event) -> None:
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True})
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            for raw in resp:
                started.set()
                if b'"error"' in raw:
                    out["error_at"] = time.monotonic()
                    return
    except OSError:
        out["closed_at"] = time.monotonic()
    finally:
        started.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="model (default: the embedded one)")
    parser.add_argument("--peer-timeout-s", type=float, default=3.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "liveness.json"))
    args = parser.parse_args(argv)
    if not args.model:
        from actorlm.gpu.default_model import default_model_path

        args.model = str(default_model_path())
    tmp = Path(tempfile.mkdtemp(prefix="actorlm-liveness-"))
    create_keys(tmp / "keys")
    port = free_port()
    lines = [
        f'[model]\npath = "{args.model}"\n',
        f"[server]\nport = {port}\n",
        f'[deploy]\npeer_timeout_s = {args.peer_timeout_s}\nkeys_dir = "{tmp / "keys"}"\n',
    ]
    for i, role in enumerate(ROLES):
        host = f"127.0.0.{i + 2}"
        lines.append(f'[actors.{role}]\naddress = "tcp://{host}:{free_port(host)}"\n')
    deploy = tmp / "cluster.toml"
    deploy.write_text("\n".join(lines))
    url = f"http://127.0.0.1:{port}"
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(role: str) -> None:
        cmd = ["serve"] if role == "gateway" else ["actor", role]
        log = (tmp / f"{role}.log").open("ab")
        procs[role] = subprocess.Popen(
            [sys.executable, "-m", "actorlm.cli", *cmd, "--deploy", str(deploy)],
            stdout=log,
            stderr=log,
        )

    def healthy(timeout: float = 600) -> float:
        t0 = time.monotonic()
        while _get(f"{url}/health")[0] != 200:
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"not healthy after {timeout}s; logs in {tmp}")
            time.sleep(0.02)
        return time.monotonic() - t0

    rows = []
    try:
        for role in [*ROLES, "gateway"]:
            start(role)
        healthy()
        for role in ROLES:
            ended: dict[str, float] = {}
            begun = threading.Event()
            thread = threading.Thread(target=_stream, args=(url, ended, begun), daemon=True)
            thread.start()
            begun.wait(60)
            time.sleep(0.5)
            procs[role].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            health_503 = None
            while time.monotonic() - killed < 30:
                status, body = _get(f"{url}/health")
                if status == 503 and role in body.get("down", []):
                    health_503 = time.monotonic() - killed
                    break
                time.sleep(0.02)
            thread.join(30)
            end = ended.get("error_at") or ended.get("closed_at")
            procs[role].wait(10)
            restarted = time.monotonic()
            start(role)
            back = healthy()
            rows.append(
                {
                    "role": role,
                    "health_503_s": None if health_503 is None else round(health_503, 2),
                    "in_flight_failed_s": None if end is None else round(end - killed, 2),
                    "back_after_start_s": round(back, 2),
                    "restart_to_serving_s": round(time.monotonic() - restarted, 2),
                }
            )
            print(f"  {role}: {rows[-1]}", flush=True)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    table = [
        "| role | /health 503 naming it (s) | in-flight request failed (s) | serving again after its start (s) |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        table.append(
            f"| {r['role']} | {r['health_503_s']} | {r['in_flight_failed_s']} | {r['back_after_start_s']} |"
        )
    print(f"peer timeout {args.peer_timeout_s} s (detection time), default model unless --model")
    print("\n".join(table))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"args": vars(args), "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2
        )
    )
    print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
