"""The installed ``kvalloc`` script against numbers at the edges: huge, non-finite, negative zero,
past 2^64 or far past a float, on the command line and inside trace files. Each is refused with
one clear line (exit status 2 for the command line, as argparse says it; 1 for a malformed
trace, naming its line), or works; never a traceback, and never a hang. Then the pacer under
``--speed``, on a clock of the test's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import clean_env

from pykvalloc.replay import simulator

TWO_64 = str(1 << 64)
HUGE = str(10 ** 400)                        # an int literal no float holds
TOO_MANY_DIGITS = "9" * 5000                 # more digits than int() reads from text (4,300)
HUGE_FRACTION = "9" * 400 + ".5G"            # a size whose float is inf

# The trace files the cases name in braces, written for each test.
TRACES = {
    # Two requests 10^10 s apart (Mooncake times are in ms): a paced replay waits out the gap.
    "gap": '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
           '{"timestamp": 1e13, "input_length": 10, "output_length": 5}\n',
    # Azure times span the whole range of a datetime.
    "far": "TIMESTAMP,ContextTokens,GeneratedTokens\n"
           "0001-01-01 00:00:00,10,5\n9999-12-31 23:59:59.9999999,10,5\n",
    # The largest finite timestamp: over a time scale of 1e-6 it is beyond a float.
    "finite_max": '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                  '{"timestamp": 1.7976931348623157e308, "input_length": 10, "output_length": 5}\n',
    "int_time": '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                f'{{"timestamp": {HUGE}, "input_length": 10, "output_length": 5}}\n',
    "digits_time": '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                   f'{{"timestamp": {TOO_MANY_DIGITS}, "input_length": 10, "output_length": 5}}\n',
    "nan_time": '{"timestamp": NaN, "input_length": 10, "output_length": 5}\n',
    "float_tokens": '{"timestamp": 0, "input_length": 1e308, "output_length": 5}\n',
    "inf_tokens": '{"timestamp": 0, "input_length": 10, "output_length": Infinity}\n',
    # Whole numbers past 2^64 are requests that can never fit: rejected and counted.
    "huge_tokens": '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                   f'{{"timestamp": 5, "input_length": {HUGE}, "output_length": {TWO_64}}}\n',
    "csv_inf_tokens": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,inf,5\n",
    "csv_digits_tokens": "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                         f"2023-11-16 18:15:46.6805900,{TOO_MANY_DIGITS},5\n",
}
TRACE_SUFFIX = {name: ".csv" if name == "far" or name.startswith("csv_") else ".jsonl" for name in TRACES}

REPLAY = ["replay", "--quiet", "--mode", "malloc-glibc"]
SMALL = ["--requests", "5"]

# (argv, exit status, what the last line of stderr says; "" for a run that works)
CASES = [
    # --speed and --time-scale: finite numbers in [1e-6, 1e6].
    *[([*REPLAY, *SMALL, f"{option}={value}"], 2, f"argument {option}: {message}")
      for option in ("--speed", "--time-scale")
      for value, message in (("1e308", "must lie between 1e-06 and 1e+06"),
                             ("1e400", "must be a finite number above 0, not '1e400'"),
                             ("inf", "must be a finite number above 0"),
                             ("-inf", "must be a finite number above 0"),
                             ("nan", "must be a finite number above 0"),
                             ("-0", "must be a finite number above 0, not '-0'"),
                             ("-1", "must be a finite number above 0"),
                             (TWO_64, "must lie between 1e-06 and 1e+06"),
                             (HUGE, "must be a finite number above 0, not '1000000000"))],
    # Counts: whole numbers from 1 to 2^64-1, or 2^32-1 for what the KV cache keeps in 32 bits.
    ([*REPLAY, "--requests", "1e308"], 2, "argument --requests: not a whole number: '1e308'"),
    ([*REPLAY, "--requests", "nan"], 2, "argument --requests: not a whole number: 'nan'"),
    ([*REPLAY, "--requests", "-0"], 2, "argument --requests: must be at least 1, not 0"),
    ([*REPLAY, "--requests", HUGE], 2, "argument --requests: must be at most 18,446,744,073,709,551,615"),
    ([*REPLAY, "--requests", TOO_MANY_DIGITS], 2, "argument --requests: must be at most 18,446,744,073,709,551,615"),
    # The embedded workload is made in memory: 2^64 requests of it never began.
    ([*REPLAY, "--requests", TWO_64[:-1]], 2, "--requests: the embedded workload holds at most 1,000,000"),
    ([*REPLAY, "{gap}", "--requests", TWO_64[:-1]], 0, ""),
    ([*REPLAY, *SMALL, "--max-batch-tokens", str((1 << 64) - 1)], 0, ""),
    ([*REPLAY, *SMALL, "--max-batch-tokens", TWO_64], 2, "argument --max-batch-tokens: must be at most"),
    *[([*REPLAY, *SMALL, option, value], 2, f"argument {option}: must be at most 4,294,967,295")
      for option in ("--block-tokens", "--layers", "--kv-heads", "--head-dim") for value in (TWO_64, HUGE)],
    ([*REPLAY, *SMALL, "--kv-tokens", TWO_64], 2, "argument --kv-tokens: must be at most"),
    # The KV capacity: at least a token, at most 2^64-1 bytes, and at most 2^32-1 blocks.
    ([*REPLAY, *SMALL, "--kv-tokens", str(1 << 60)], 2,
     "--kv-tokens 1,152,921,504,606,846,976 at 128 KiB per token is more than 2^64-1 bytes"),
    (["replay", "--quiet", *SMALL, "--kv-tokens", str(1 << 40), "--layers", "1", "--kv-heads", "1",
      "--head-dim", "1"], 2, "--kv-tokens 1,099,511,627,776 is 68,719,476,736 blocks of 16 tokens"),
    (["replay", "--quiet", *SMALL, "--kv-tokens", "1", "--block-tokens", str(1 << 20), "--layers", "65536",
      "--kv-heads", "65536", "--head-dim", "65536"], 2,
     "a block of 1,048,576 tokens at 1024 TiB per token is more than 2^64-1 bytes"),
    ([*REPLAY, *SMALL, "--kv-size", "1000"], 2, "--kv-size 1000 B holds not one token of this model"),
    ([*REPLAY, *SMALL, "--kv-size", "-0"], 2, "argument --kv-size: not a size: '-0'"),
    ([*REPLAY, *SMALL, "--kv-size", "1e400"], 2, "argument --kv-size: not a size: '1e400'"),
    ([*REPLAY, *SMALL, "--kv-size", "16777216T"], 2, "argument --kv-size: more than 2^64-1 bytes"),
    ([*REPLAY, *SMALL, "--kv-size", HUGE], 2, "argument --kv-size: more than 2^64-1 bytes"),
    ([*REPLAY, *SMALL, "--kv-size", TOO_MANY_DIGITS], 2, "argument --kv-size: more than 2^64-1 bytes"),
    ([*REPLAY, *SMALL, "--kv-size", HUGE_FRACTION], 2, "argument --kv-size: more than 2^64-1 bytes"),
    # --speed waits out a gap between arrivals, but never more than 10 s at a time: a gap of
    # 10^10 s at --speed 1 ended in an OverflowError traceback (a wait past what a lock's timeout
    # holds), and at --speed 1e6 it waited 10^4 s.
    ([*REPLAY, "{gap}", "--speed", "1"], 0, ""),
    ([*REPLAY, "{gap}", "--speed", "1e6"], 0, ""),
    ([*REPLAY, "{gap}"], 0, ""),
    ([*REPLAY, "{far}"], 0, ""),
    ([*REPLAY, "{finite_max}"], 0, ""),
    ([*REPLAY, "{finite_max}", "--time-scale", "1e-6"], 2,
     "--time-scale: the arrival at 1.79769e+305 s divided by the time scale 1e-06 is beyond a float's range"),
    # Fields of a trace: a malformed row is exit status 1, naming its line.
    ([*REPLAY, "{int_time}"], 1, ":2: the timestamp 1000000000"),
    ([*REPLAY, "{digits_time}"], 1, ":2: the number '999999999999..."),
    ([*REPLAY, "{nan_time}"], 1, ":1: NaN is not a JSON number"),
    ([*REPLAY, "{float_tokens}"], 1, ":1: input_length must be a positive integer, got 1e+308"),
    ([*REPLAY, "{inf_tokens}"], 1, ":1: Infinity is not a JSON number"),
    ([*REPLAY, "{huge_tokens}"], 1, ""),       # the huge request is rejected, the other finishes
    ([*REPLAY, "{csv_inf_tokens}"], 1, ":2: ContextTokens must be a positive integer, got 'inf'"),
    ([*REPLAY, "{csv_digits_tokens}"], 1, ":2: ContextTokens '999999999999...9999999999999' is too large"),
    # The demo: the embedded workload and a paged cache.
    (["demo", "--no-tui", "--requests", TWO_64], 2, "argument --requests: must be at most 1,000,000"),
    (["demo", "--no-tui", "--requests", "-0"], 2, "argument --requests: must be at least 1, not 0"),
    (["demo", "--no-tui", "--kv-size", "1000"], 2, "--kv-size 1000 B holds not one token of this model"),
    (["demo", "--no-tui", "--kv-size", HUGE], 2, "argument --kv-size: more than 2^64-1 bytes"),
    (["demo", "--no-tui", "--kv-size", "16383T"], 2,
     "--kv-size 16383 TiB is 8,589,410,304 blocks of 16 tokens; a KV cache holds at most 4,294,967,295"),
    *[(["demo", "--no-tui", "--speed", value], 2, "argument --speed: must") for value in ("1e400", "nan", "-0", HUGE)],
    # kvalloc top's --interval is read before it looks for a pool.
    *[(["top", "--interval", value], 2, "argument --interval: the interval must lie in [0.1, 10] seconds")
      for value in ("1e308", "1e400", "inf", "nan", "-0", "-1", TWO_64, HUGE)],
]


def _script() -> Path:
    script = Path(sys.executable).parent / "kvalloc"
    if not script.is_file():
        pytest.skip("the kvalloc script is not installed beside this interpreter")
    return script


def _case_id(case: tuple[list[str], int, str]) -> str:
    argv = [word if len(word) <= 24 else f"{word[:8]}..{len(word)}chars" for word in case[0]]
    return " ".join(argv)


@pytest.mark.parametrize("argv, status, message", CASES, ids=[_case_id(case) for case in CASES])
def test_numbers_at_the_edges(tmp_path: Path, argv: list[str], status: int, message: str) -> None:
    paths = {}
    for name, text in TRACES.items():
        if "{" + name + "}" in argv:
            paths[name] = tmp_path / f"{name}{TRACE_SUFFIX[name]}"
            paths[name].write_text(text)
    words = [word.format(**paths) if word.startswith("{") else word for word in argv]
    # A bound against a hang, not a measure: the slowest case waits out one 10 s gap.
    done = subprocess.run([str(_script()), *words], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=clean_env(), timeout=120)
    said = f"exit status {done.returncode}; stderr:\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, said
    assert done.returncode == status, said
    if message:
        lines = done.stderr.strip().splitlines()
        assert message in lines[-1], said
        assert len(lines[-1]) < 300, said         # a huge value is shown cut short
    else:
        assert done.stderr.strip() == "", said


class _Clock:
    """A clock that moves only when the pacer waits, recording each wait."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False


# The waits a pacer at each speed asks for over four steps: a gap of 10^10 s between arrivals,
# the next step 10 ms of simulated time later, a gap whose wall time at 1e-6 is past a float's
# range, and a step that adds nothing (no wait).
@pytest.mark.parametrize("speed, waits", [(1.0, [10.0, 0.01, 10.0]), (1e-6, [10.0, 10.0, 10.0]),
                                          (1e6, [10.0, 10.0])])
def test_the_pacer_waits_at_most_10_s_and_keeps_the_pace_after(monkeypatch, speed: float,
                                                                waits: list[float]) -> None:
    assert simulator.LONGEST_PACED_WAIT_S == 10.0
    clock = _Clock()
    monkeypatch.setattr(simulator.time, "perf_counter", lambda: clock.now)
    hold = simulator.pacer(speed, stop=clock)  # type: ignore[arg-type]
    for simulated_s in (1e10, 1e10 + 0.01, 1.7e308, 1.7e308):
        hold(simulated_s)
    assert clock.waits == pytest.approx(waits, abs=1e-5)
