"""Start ``skipdecode serve`` as a real process on 127.0.0.1 and wait for it."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    """Something other than HTTP answered on the server's port."""


class Server:
    def __init__(self, model_dir: Path, *args: str, timeout: float = 120.0, tries: int = 3):
        # the port is free when chosen, but a process the server starts (Ray's own services bind
        # ports the OS picks) may take it before the server listens: then start again on another
        for _ in range(tries):
            if self._start(model_dir, args, timeout):
                return
            out = self.output()
            self.stop()
        raise RuntimeError(f"in {tries} tries, something other than the server answered on its port: {out}")

    def _start(self, model_dir: Path, args: tuple[str, ...], timeout: float) -> bool:
        """Launch on a free port and wait until healthy: True, or False when the port was taken."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        self.log = open(Path(model_dir).parent / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skipdecode.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if self.health() == 200:
                    return True
            except PortTaken:
                return False
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s: {self.output()}")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except http.client.HTTPException as e:  # not an HTTP reply: another program holds the port
            raise PortTaken(str(e)) from None
        except OSError:
            return None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            out = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    out[k] = float(v)
            return out

    def metric(self, name: str, **labels: str) -> float:
        """One series of /metrics by name and labels (any label order); 0 when absent."""
        total = 0.0
        for k, v in self.metrics().items():
            base, _, rest = k.partition("{")
            got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv) if rest else {}
            if base == name and all(got.get(lk) == f'"{lv}"' for lk, lv in labels.items()):
                total += v
        return total

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode
