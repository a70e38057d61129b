"""A real Prometheus server scrapes ``kvalloc export``: Debian's ``prometheus`` package
(``scripts/ensure-system-deps.sh`` installs it) runs with a generated configuration (scrape
interval 1 s, its storage in a temporary directory, free ports), and the test asks its HTTP API
for a counter that its own KV cache moved, until Prometheus holds the value the cache states."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from stats_writer import unique_name
from support import clean_env

import pykvalloc

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Debian's prometheus package is not installed, and this machine cannot install it "
           "(scripts/ensure-system-deps.sh installs it as root with apt-get)")

# Hang guards count polls of POLL_S; these bounds are generous (minutes), and say "hung".
POLL_S = 0.1
STARTUP_POLLS = 1200
SCRAPE_POLLS = 1200


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def exporter() -> Iterator[str]:
    """``kvalloc export --port 0`` in a child process; yields its host:port."""
    # Every segment read, so that other tests' pools cannot push ours past the limit.
    with subprocess.Popen([sys.executable, "-m", "kvalloc_cli", "export", "--port", "0",
                           "--max-segments", str(1 << 20)],
                          stderr=subprocess.PIPE, text=True, env=clean_env()) as process:
        try:
            assert process.stderr is not None
            line = process.stderr.readline().strip()
            match = re.match(r"kvalloc export: serving http://(127\.0\.0\.1:\d+)/metrics$", line)
            assert match, f"the exporter hung or failed at its start: {line!r}"
            yield match.group(1)
        finally:
            process.terminate()
            process.wait(timeout=60)


@contextmanager
def prometheus(target: str, directory: Path) -> Iterator[str]:
    """A Prometheus server scraping ``target`` every second; yields its base URL."""
    assert PROMETHEUS is not None
    port = free_port()
    config = directory / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: kvalloc\n"
        "    static_configs:\n"
        f"      - targets: ['{target}']\n")
    log = (directory / "prometheus.log").open("w")
    with subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                           f"--storage.tsdb.path={directory / 'data'}",
                           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                          stdout=log, stderr=subprocess.STDOUT, cwd=directory) as process:
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(STARTUP_POLLS):
                assert process.poll() is None, \
                    f"prometheus exited: {(directory / 'prometheus.log').read_text()}"
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=10) as ready:
                        if ready.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError):
                    pass
                time.sleep(POLL_S)
            else:
                pytest.fail(f"hung: prometheus not ready after {STARTUP_POLLS} polls")
            yield base
        finally:
            process.terminate()
            process.wait(timeout=60)
            log.close()


def query(base: str, expression: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expression})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    result: list[dict] = answer["data"]["result"]
    return result


def scraped_value(base: str, expression: str, wanted: float) -> float:
    """Polls Prometheus until ``expression`` has the value ``wanted`` (bounded); returns the
    last value it had, which the caller asserts."""
    last = None
    for _ in range(SCRAPE_POLLS):
        result = query(base, expression)
        if result:
            last = float(result[0]["value"][1])
            if last == wanted:
                return last
        time.sleep(POLL_S)
    pytest.fail(f"hung: after {SCRAPE_POLLS} polls Prometheus has {expression} = {last}, "
                f"the cache says {wanted}")


def test_prometheus_scrapes_the_counter_our_cache_moved(tmp_path: Path) -> None:
    name = unique_name("prom")
    with pykvalloc.KVCache(num_blocks=64, block_tokens=16, layers=2, kv_heads=2, head_dim=64,
                           name=name) as cache, exporter() as target, \
            prometheus(target, tmp_path) as base:
        hits = f'kvalloc_kv_prefix_cache_hit_tokens_total{{job="kvalloc",pool="{name}"}}'
        cache.allocate(64, block_keys=[1, 2, 3, 4]).free()
        cache.allocate(64, block_keys=[1, 2, 3, 4]).free()  # 64 tokens hit
        cache.publish()
        assert cache.stats().hit_tokens == 64
        assert scraped_value(base, hits, 64) == cache.stats().hit_tokens
        # It moves again, and Prometheus follows: a counter of our own, not a coincidence.
        cache.allocate(48, block_keys=[1, 2, 3]).free()
        cache.publish()
        assert scraped_value(base, hits, 112) == cache.stats().hit_tokens == 112
        assert float(query(base, f'up{{job="kvalloc"}}')[0]["value"][1]) == 1
        allocations = f'kvalloc_kv_call_duration_seconds_count{{pool="{name}",call="allocate"}}'
        assert query(base, allocations), "the KV latency histogram reached Prometheus"
