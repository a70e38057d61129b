"""``kvalloc demo``: the main job, on the embedded workload. LLM-serving traffic drawn from
published statistics of real traces is replayed through a named KV cache (paged, 16-token
blocks, 2 GiB of KV for a Llama-3-8B-sized model, so that it fills up and preempts now and then).
The engine also allocates, from the same pool, what a serving engine allocates around its KV
cache (``kvalloc replay --engine-buffers``): per-step activation and attention-output buffers
through the buddy, scratch buffers and token metadata through slab classes, so the inspector's
buddy orders, slab classes and fragmentation move; the report says what each kind cost. And it
serves several tenants, as a multi-tenant engine does (``kvalloc replay --tenants 4
--pin-system-prompt``): each conversation in one of 4 namespaces, prefixes shared only within
one, and the system prompt every request opens with pinned in each namespace once cached, so the
inspector's namespaces panel has a row per tenant and its KV bar and heap map show pinned blocks.

On a terminal the replay runs in a second process, held to --speed simulated seconds per second,
and ``kvalloc top`` watches it live through its statistics segment, as an operator would watch an
engine. Quit with q: the report follows, for the whole replay once it has finished (about 12 s
at the default --speed), or for the part replayed so far if you quit sooner.
Otherwise (scripts, CI) the replay runs at full speed and prints its report: a couple of seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pykvalloc.errors import InvalidArgument, SegmentNotFound
from pykvalloc.replay.backends import Geometry
from pykvalloc.replay.simulator import ReplayConfig, replay
from pykvalloc.replay.workload import MAX_REQUESTS, default_workload
from pykvalloc.sizes import format_size
from pykvalloc.stats import find_segment

from . import extras
from .arguments import add_command, positive_number, positive_size, usage_error, whole_number
from .replay import capacity_tokens
from .report import print_report

POOL_NAME = "kvalloc-demo"
TENANTS = 4  # namespaces the demo's conversations are spread over
PUBLISH_WITHIN_S = 60


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "demo", "replay the embedded workload, watching it live", __doc__,
                         after_usage=False)
    parser.add_argument("--requests", type=whole_number(MAX_REQUESTS), default=2000,
                        help=f"requests to replay, at most {MAX_REQUESTS:,} (default 2000)")
    parser.add_argument("--kv-size", type=positive_size, default=2 << 30, help="KV capacity (default 2G)")
    parser.add_argument("--speed", type=positive_number, default=30.0,
                        help="simulated seconds per second when watched live (default 30)")
    parser.add_argument("--no-tui", action="store_true", help="print the report without watching live")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        capacity_tokens(args.kv_size, None, Geometry(), block_tokens=16)
    except InvalidArgument as exc:
        return usage_error("demo", str(exc))
    if args.no_tui or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return headless(args)
    return watched(args)


def headless(args: argparse.Namespace) -> int:
    geometry = Geometry()
    config = ReplayConfig(mode="paged", capacity_tokens=args.kv_size // geometry.bytes_per_token,
                          geometry=geometry, pool_name=POOL_NAME, engine_buffers=True, tenants=TENANTS,
                          pin_system_prompt=True)
    print(f"Replaying {args.requests:,} requests of the embedded workload through a "
          f"{format_size(args.kv_size)} paged KV cache (pool {POOL_NAME!r})...", file=sys.stderr)
    result = replay(default_workload(args.requests), config)
    print_report([result])
    return 0 if result.finished == result.requests else 1


def watched(args: argparse.Namespace) -> int:
    """The replay in a child process, kvalloc top in this one, the report at the end."""
    hint = extras.install_hint(extras.TEXTUAL)
    if hint:
        print(f"kvalloc demo: watching live {hint} (--no-tui replays without it)", file=sys.stderr)
        return 1
    name = f"{POOL_NAME}-{os.getpid()}"
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        engine = subprocess.Popen(
            [sys.executable, "-m", "kvalloc_cli", "replay", "--requests", str(args.requests),
             "--kv-size", str(args.kv_size), "--name", name, "--speed", str(args.speed), "--quiet",
             "--engine-buffers", "--tenants", str(TENANTS), "--pin-system-prompt",
             "--output", str(report)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            target = _wait_for_segment(name, engine)
            from kvalloc_tui.app import KvallocTop  # Textual loads only on a terminal
            KvallocTop(target, interval=0.5).run()
        finally:
            if engine.poll() is None:
                engine.terminate()  # the replay stops at its next step and writes what it has
            _, errors = engine.communicate()
        if not report.exists():
            print(f"kvalloc demo: the replay did not finish{': ' + errors.strip() if errors.strip() else ''}",
                  file=sys.stderr)
            return 1
        payload = json.loads(report.read_text())["runs"][0]
    print_report([payload])
    if payload.get("stopped"):
        return 0  # you quit before the end: the report covers the run until then
    return 0 if payload["finished"] == payload["requests"] else 1


def _wait_for_segment(name: str, engine: subprocess.Popen[str]) -> Any:
    # A bound against a replay that hangs before it publishes, generous for a loaded machine:
    # one that fails says so at once (it exits).
    deadline = time.monotonic() + PUBLISH_WITHIN_S
    while time.monotonic() < deadline:
        try:
            return find_segment(name)
        except SegmentNotFound:
            if engine.poll() is not None:
                raise InvalidArgument(f"the replay ended before it published (exit {engine.returncode}): "
                                      f"{engine.stderr.read() if engine.stderr else ''}") from None
            time.sleep(0.05)
    raise InvalidArgument(f"the replay did not publish its statistics within {PUBLISH_WITHIN_S} s")
