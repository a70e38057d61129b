"""``kvalloc replay [TRACE]``: real LLM-serving traffic through the real allocator.

TRACE is an Azure LLM inference trace CSV or a Mooncake JSON-lines trace; without it, the
embedded default workload (published statistics of real traffic) is replayed. ``--compare``
runs paged (16/32/64/128-token blocks), contiguous and per-request malloc (glibc, and jemalloc
where installed) on the same traffic and prints them side by side; a configuration that fails
shows as a failed column with its reason.

A request that can never complete on the KV cache, even alone (its prompt and answer beyond the
capacity, or in contiguous mode beyond max_context or the buckets its growth holds at once), is
rejected and counted, as an engine rejects it. The exit status is 1 when a request was rejected
or a configuration failed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pykvalloc.errors import InvalidArgument, KvallocError
from pykvalloc.kvcache import DEFAULT_BLOCK_TOKENS, KVGroup
from pykvalloc.replay.backends import Geometry, jemalloc_is_malloc, jemalloc_path
from pykvalloc.replay.model_config import read_model_config
from pykvalloc.replay.simulator import (LONGEST_PACED_WAIT_S, MAX_TENANTS, ReplayConfig, ReplayResult,
                                        check_arrivals, keyable, pacer, replay, system_prompt,
                                        system_prompt_keys)
from pykvalloc.replay.traces import Trace, load_trace
from pykvalloc.replay.workload import MAX_REQUESTS, default_workload
from pykvalloc.sizes import format_size

from .arguments import (COUNT_MAX, U32_MAX, add_command, kv_dtype, kv_group, output_file, positive_int,
                        positive_int32, positive_number, positive_size, usage_error, whole_number)
from .output import add_report_options, emit_json, wants_table, wrote
from .report import failed, print_report, report_json, write_plot

MODES = ("paged", "contiguous", "malloc-glibc", "malloc-jemalloc")


def register(subparsers: Any) -> None:
    parser = add_command(subparsers, "replay", "replay LLM-serving traffic through the allocator", __doc__,
                         after_usage=False)
    add_arguments(parser)
    parser.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", type=Path, help="Azure CSV or Mooncake JSONL (default: embedded workload)")
    parser.add_argument("--mode", choices=MODES, default="paged",
                        help="how the KV memory is managed (default: paged)")
    parser.add_argument("--block-tokens", type=positive_int32, default=None,
                        help=f"tokens per KV block (paged, not --compare; default {DEFAULT_BLOCK_TOKENS}). "
                             "Prefix caching keys "
                             "blocks from the trace's 512-token hash ids, so it needs a size that divides 512 "
                             "or is a multiple of it; with any other, prefix caching is off and the hit rate "
                             "shows as -")
    parser.add_argument("--kv-size", type=positive_size, default=None,
                        help="KV capacity in bytes, e.g. 8G (default: 8 GiB)")
    parser.add_argument("--kv-tokens", type=positive_int, default=None,
                        help="KV capacity in tokens (instead of --kv-size)")
    parser.add_argument("--requests", type=positive_int, default=None, help="replay only the first N requests")
    parser.add_argument("--time-scale", type=positive_number, default=1.0,
                        help="trace seconds per simulated second: above 1 the arrivals come faster (default 1)")
    parser.add_argument("--max-batch-tokens", type=positive_int, default=8192,
                        help="tokens one engine step may process, decodes and prompt chunks (default 8192)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="paged: do not key blocks by the trace's prefix ids")
    parser.add_argument("--layers", type=positive_int32, default=None,
                        help="the model's layers (default 32: a Llama-3-8B-like model)")
    parser.add_argument("--kv-heads", type=positive_int32, default=None, help="KV heads per layer (default 8)")
    parser.add_argument("--head-dim", type=positive_int32, default=None, help="dimension of a head (default 128)")
    parser.add_argument("--kv-lora-rank", type=positive_int32, default=None,
                        help="multi-head latent attention (DeepSeek): one latent vector of KV_LORA_RANK + "
                             "--rope-dim elements per token and layer instead of K and V")
    parser.add_argument("--rope-dim", type=positive_int32, default=None,
                        help="with --kv-lora-rank: the rotary part of the latent vector (qk_rope_head_dim)")
    parser.add_argument("--group", type=kv_group, action="append", default=None, metavar="L:H:D[:P]",
                        help="layers of one shape, repeatable for a model whose layers differ: L layers of P "
                             "vectors (2, K and V, by default; 1 for MLA) of H heads of D elements")
    parser.add_argument("--model-config", type=Path, default=None, metavar="CONFIG.json",
                        help="the shape from a Hugging Face config.json: num_hidden_layers, num_key_value_heads, "
                             "head_dim (or hidden_size / num_attention_heads), kv_lora_rank + qk_rope_head_dim "
                             "for MLA, torch_dtype")
    parser.add_argument("--dtype", type=kv_dtype, default=None,
                        help="the KV cache's element type (default: the model config's, else float16)")
    parser.add_argument("--skip-bad", action="store_true", help="skip and count malformed trace rows")
    parser.add_argument("--compare", action="store_true",
                        help="paged 16/32/64/128, contiguous and malloc on the same traffic")
    parser.add_argument("--name", default=None, help="publish live stats under this pool name (kvalloc top)")
    parser.add_argument("--engine-buffers", action="store_true",
                        help="paged: also allocate what an engine allocates around its KV cache, in the same "
                             "pool (per-step activations and attention output through the buddy, scratch and "
                             "token metadata through slab classes), and report what each cost")
    parser.add_argument("--tenants", type=whole_number(MAX_TENANTS), default=None, metavar="N",
                        help="paged: spread the conversations over N namespaces, as a multi-tenant engine "
                             "keeps tenants apart: a conversation (its first hash id past the system prompt; "
                             "a request without one is its own) goes to namespace hash(id) %% N, and prefixes "
                             "are shared only within a namespace (default: all in one)")
    parser.add_argument("--pin-system-prompt", action="store_true",
                        help="paged: pin the prefix most requests open with (the trace's system prompt, "
                             "Mooncake's hash id 0) in each tenant's namespace once a request has cached it "
                             "there, for the rest of the run, as an engine keeps its system prompt resident")
    add_report_options(parser, "the report (runs: one per configuration)")
    parser.add_argument("--plot", type=output_file, default=None, metavar="FILE.png",
                        help="plot KV use and hit rate over time (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    # The jemalloc configuration of --compare --plot runs in a child process: its samples come
    # back in its JSON report.
    parser.add_argument("--with-samples", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--speed", type=positive_number, default=None,
                        help="hold the replay to SPEED simulated seconds per second, to watch it "
                             "live with kvalloc top; no wait between two steps lasts more than "
                             f"{LONGEST_PACED_WAIT_S:g} s, so a longer gap between arrivals is cut "
                             "short (default: as fast as it runs)")


def read_traffic(args: argparse.Namespace) -> Trace:
    if not args.trace:
        return default_workload(args.requests if args.requests is not None else 2000)
    trace = load_trace(args.trace, skip_bad=args.skip_bad)
    if args.requests is not None:
        trace.requests = trace.requests[:args.requests]
    return trace


def capacity_tokens(kv_size: Optional[int], kv_tokens: Optional[int], geometry: Geometry,
                    block_tokens: Optional[int]) -> int:
    """The KV capacity in tokens, from ``kv_tokens`` or else ``kv_size`` (8 GiB when neither is
    given). InvalidArgument, naming the option, for a capacity the library would refuse only once
    the replay began: less than a token, more than 2^64-1 bytes, or, for a paged cache of
    ``block_tokens`` a block, more than 2^32-1 blocks or blocks of more than 2^64-1 bytes."""
    per_token = geometry.bytes_per_token
    if kv_tokens is not None:
        tokens, option = kv_tokens, f"--kv-tokens {kv_tokens:,}"
    else:
        size = kv_size if kv_size is not None else 8 << 30
        tokens, option = size // per_token, f"--kv-size {format_size(size)}"
    if tokens < 1:
        raise InvalidArgument(f"{option} holds not one token of this model ({format_size(per_token)} per token)")
    if tokens * per_token > COUNT_MAX:
        raise InvalidArgument(f"{option} at {format_size(per_token)} per token is more than 2^64-1 bytes")
    if block_tokens is not None:
        if tokens // block_tokens > U32_MAX:
            raise InvalidArgument(f"{option} is {tokens // block_tokens:,} blocks of {block_tokens} tokens; "
                                  f"a KV cache holds at most {U32_MAX:,}")
        if block_tokens * per_token > COUNT_MAX:
            raise InvalidArgument(f"a block of {block_tokens:,} tokens at {format_size(per_token)} per token "
                                  f"is more than 2^64-1 bytes")
    return tokens


def geometry_of(args: argparse.Namespace) -> Geometry:
    """The model's KV shape from the options: --layers/--kv-heads/--head-dim, --kv-lora-rank and
    --rope-dim (MLA), --group or --model-config, one way at a time."""
    plain = [name for name, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads),
                                      ("--head-dim", args.head_dim)) if value is not None]
    mla = [name for name, value in (("--kv-lora-rank", args.kv_lora_rank), ("--rope-dim", args.rope_dim))
           if value is not None]
    if args.model_config is not None and (plain or mla or args.group):
        raise InvalidArgument(f"--model-config gives the model's shape; {', '.join(plain + mla) or '--group'} "
                              "would give it again")
    if args.group and (plain or mla):
        raise InvalidArgument(f"--group gives the model's shape; {', '.join(plain + mla)} would give it again")
    if mla and len(mla) < 2:
        raise InvalidArgument("multi-head latent attention needs both --kv-lora-rank and --rope-dim")
    if mla and (args.kv_heads is not None or args.head_dim is not None):
        raise InvalidArgument("--kv-lora-rank and --rope-dim replace --kv-heads and --head-dim")
    dtype = args.dtype
    groups: tuple[KVGroup, ...] = ()
    hidden = None
    if args.model_config is not None:
        model = read_model_config(args.model_config)
        groups, dtype, hidden = model.groups, dtype or model.dtype, model.hidden_size
    elif args.group:
        groups = tuple(args.group)
    elif mla:
        groups = (KVGroup.mla(args.layers if args.layers is not None else 32, args.kv_lora_rank, args.rope_dim),)
    if groups:
        return Geometry(layers=sum(group.layers for group in groups), dtype=dtype or "float16", groups=groups,
                        hidden_size=hidden)
    return Geometry(layers=args.layers if args.layers is not None else 32,
                    kv_heads=args.kv_heads if args.kv_heads is not None else 8,
                    head_dim=args.head_dim if args.head_dim is not None else 128, dtype=dtype or "float16")


def base_config(args: argparse.Namespace) -> ReplayConfig:
    geometry = geometry_of(args)
    # --compare's smallest block is the paged default.
    paged_block = (DEFAULT_BLOCK_TOKENS if args.compare else (args.block_tokens or DEFAULT_BLOCK_TOKENS)
                   if args.mode == "paged" else None)
    tokens = capacity_tokens(args.kv_size, args.kv_tokens, geometry, paged_block)
    return ReplayConfig(mode=args.mode, block_tokens=args.block_tokens or DEFAULT_BLOCK_TOKENS, capacity_tokens=tokens, geometry=geometry,
                        max_batch_tokens=args.max_batch_tokens, time_scale=args.time_scale,
                        prefix_caching=not args.no_prefix_caching, pool_name=args.name,
                        sample_every=16 if args.plot or args.with_samples else 1 << 30,
                        engine_buffers=args.engine_buffers, tenants=args.tenants,
                        pin_system_prompt=args.pin_system_prompt)


def configurations(args: argparse.Namespace) -> list[ReplayConfig]:
    base = base_config(args)
    if not args.compare:
        return [base]
    out = [ReplayConfig(**{**base.__dict__, "mode": "paged", "block_tokens": b})
           for b in (DEFAULT_BLOCK_TOKENS << doubling for doubling in range(4))]
    out.append(ReplayConfig(**{**base.__dict__, "mode": "contiguous"}))
    out.append(ReplayConfig(**{**base.__dict__, "mode": "malloc-glibc"}))
    if jemalloc_path():
        out.append(ReplayConfig(**{**base.__dict__, "mode": "malloc-jemalloc"}))
    return out


def replay_preloaded(args: argparse.Namespace, config: ReplayConfig) -> dict[str, Any]:
    """The same replay in a child process with jemalloc preloaded; its report as a dict."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "report.json"
        argv = [sys.executable, "-m", "kvalloc_cli", "replay", "--mode", "malloc-jemalloc", "--quiet",
                "--kv-tokens", str(config.capacity_tokens), "--time-scale", str(config.time_scale),
                "--max-batch-tokens", str(config.max_batch_tokens), "--dtype", config.geometry.dtype,
                "--output", str(out)]
        for group in config.geometry.describe().split():
            argv += ["--group", group]
        if args.trace:
            argv.insert(4, str(args.trace))
        if args.requests is not None:
            argv += ["--requests", str(args.requests)]
        if args.skip_bad:
            argv.append("--skip-bad")
        if args.plot:
            argv.append("--with-samples")
        env = {**os.environ, "LD_PRELOAD": str(jemalloc_path())}
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        # Exit status 1 with a report is the child's verdict on requests it had to reject, which
        # the report says too; without a report the replay itself failed.
        if not out.exists():
            reason = done.stderr.strip() or f"exit status {done.returncode}"
            raise InvalidArgument(f"the jemalloc replay failed: {reason}")
        return dict(json.loads(out.read_text())["runs"][0])


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """While a replay held to a --speed runs (one a person watches, such as the demo's), SIGTERM
    and SIGINT ask it to stop at its next step and report what it got through, instead of ending
    the process with nothing to show."""
    asked = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: asked.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield asked
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_all(args: argparse.Namespace, trace: Trace, configs: list[ReplayConfig], quiet: bool, status: Console,
            speed: Optional[float] = None,
            stop: Optional[threading.Event] = None) -> list[ReplayResult | dict[str, Any]]:
    """Every configuration's replay; ``status`` (stderr) takes the progress bar and the warnings."""
    results: list[ReplayResult | dict[str, Any]] = []
    if trace.skipped:
        status.print(f"skipped {trace.skipped} malformed rows (first: line {trace.skipped_examples[0][0]}: "
                     f"{trace.skipped_examples[0][1]})", style="yellow", markup=False, highlight=False)
    unkeyed = sorted({c.block_tokens for c in configs if c.mode == "paged" and c.prefix_caching
                      and not keyable(c.block_tokens)})
    if unkeyed and any(r.hash_ids for r in trace.requests):
        status.print(f"--block-tokens {unkeyed[0]} neither divides nor is a multiple of the trace's 512-token "
                     f"hash blocks: prefix caching is off and its hit rate is not measured", style="yellow")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=status, disable=quiet or len(trace.requests) < 2000) as progress:
        for config in configs:
            task = progress.add_task(f"{config.mode}/{config.block_tokens}", total=len(trace.requests))

            def update(finished: int, total: int, task: Any = task) -> None:
                progress.update(task, completed=finished)

            try:
                if config.mode == "malloc-jemalloc" and not jemalloc_is_malloc():
                    results.append(replay_preloaded(args, config))
                else:
                    results.append(replay(trace, config, progress=update,
                                          on_step=pacer(speed, stop) if speed else None,
                                          should_stop=stop.is_set if stop is not None else None))
            except KvallocError as exc:
                if len(configs) == 1:
                    raise
                # One configuration's failure (a pool too small for contiguous buckets, say)
                # must not cost the comparison the others made.
                results.append(failed(config, trace, exc))
            progress.update(task, completed=len(trace.requests))
    return results


def run(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Said before the replay, not after it (with a traceback, as it once was).
        return usage_error("replay", "--plot needs matplotlib: pip install 'pykvalloc[plot]'")
    if args.engine_buffers and (args.mode != "paged" or args.compare):
        return usage_error("replay", "--engine-buffers applies to --mode paged without --compare")
    for option, given in (("--tenants", args.tenants is not None), ("--pin-system-prompt", args.pin_system_prompt)):
        if given and (args.mode != "paged" or args.compare):
            # Namespaces and pins are the prefix cache's: contiguous and malloc have none, and
            # --compare's table has no room for a tenant's figures.
            return usage_error("replay", f"{option} applies to --mode paged without --compare")
    if args.block_tokens is not None and (args.mode != "paged" or args.compare):
        # It was taken and ignored: contiguous and malloc have no blocks, --compare runs 16 .. 128.
        return usage_error("replay", "--block-tokens applies to --mode paged without --compare")
    if not args.trace and args.requests is not None and args.requests > MAX_REQUESTS:
        return usage_error("replay", f"--requests: the embedded workload holds at most {MAX_REQUESTS:,} "
                                     f"requests (a trace file may hold more)")
    try:
        configs = configurations(args)
    except InvalidArgument as exc:
        return usage_error("replay", str(exc))
    trace = read_traffic(args)
    try:
        check_arrivals(trace, args.time_scale)
    except InvalidArgument as exc:
        return usage_error("replay", f"--time-scale: {exc}")
    if args.pin_system_prompt:
        try:
            system_prompt_keys(configs[0], trace, system_prompt(trace))
        except InvalidArgument as exc:
            return usage_error("replay", f"--pin-system-prompt: {exc}")
    with stop_on_signals() if args.speed else contextlib.nullcontext() as stop:
        results = run_all(args, trace, configs, args.quiet, Console(stderr=True), args.speed, stop)
    if wants_table(args):
        print_report(results)
    emit_json(args, report_json(results, samples=args.with_samples))
    if args.plot:
        write_plot(results, args.plot)
        wrote(args.plot)
    rows = report_json(results)["runs"]
    if any(r.get("stopped") for r in rows):
        return 130  # interrupted, as a shell counts it; the report covers the run so far
    return 0 if all("error" not in r and r["finished"] == r["requests"] for r in rows) else 1
