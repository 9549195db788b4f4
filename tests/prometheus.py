"""A real Prometheus for the tests (Debian's ``prometheus`` package): a config that scrapes the
given targets every second and evaluates the given rule files every second, its data in a
temporary directory, listening on loopback, started and stopped by its PID."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.services import free_port, stop


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The active alerts (pending or firing) of that name."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"].get("alertname") == name]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])


@contextlib.contextmanager
def running_prometheus(base: Path, targets: list[str], rule_files: list[Path]) -> Iterator[Prometheus]:
    base.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "dflash-watch", "static_configs": [{"targets": targets}]}],
    }
    (base / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (base / "prometheus.log").open("w")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={base / 'prometheus.yml'}", f"--storage.tsdb.path={base / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=base,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not start: {(base / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield Prometheus(port)
    finally:
        stop(proc, signal.SIGTERM)  # its clean shutdown
        log.close()
