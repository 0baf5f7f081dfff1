"""Start `execupy serve` as a real process on 127.0.0.1 and a free port; always stop it."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def log(self) -> str:
        """What the server wrote to stderr so far."""
        return self.log_path.read_text()

    def http(self, method: str, path: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, dict]:
        """A raw HTTP request; (status, JSON body)."""
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@contextlib.contextmanager
def running_server(pte: Path, log_path: Path, *args: str, startup_s: float = 120) -> Iterator[Server]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "execupy", "serve", str(pte), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=REPO)
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"execupy serve exited with {process.returncode}:\n{server.log}")
            try:
                if server.http("GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"execupy serve did not answer /health in {startup_s} s:\n{server.log}")
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
