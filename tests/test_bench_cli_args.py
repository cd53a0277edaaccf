"""The benchmarks' arguments (bench/cli_args.py): a value the run cannot use is refused by
argparse before any mesh starts, and --quick fills in only what the command line leaves out."""

from __future__ import annotations

import argparse

import pytest

from bench import relay, speculative, wan
from bench.cli_args import parse_with_quick
from bench.relay import DelayRelay
from bus.cli_args import number, number_list


def test_numbers_and_lists_within_their_bounds() -> None:
    assert number_list(0)("0, 20,50") == [0.0, 20.0, 50.0]
    assert number_list(1, 30, integer=True)("2,3") == [2, 3]
    for bad in ("abc", "-30", "0,x", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            number_list(0)(bad)
    for bad in ("0", "31", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            number_list(1, 30, integer=True)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="above 0"):
        number(0, above=True)("0")


def test_quick_keeps_the_flags_given() -> None:
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser()
        p.add_argument("--quick", action="store_true")
        p.add_argument("--hops", type=number_list(1, integer=True), default="2,3")
        p.add_argument("--decode", type=number(2, integer=True), default=32)
        return p

    quick = {"hops": "2", "decode": 8}
    assert vars(parse_with_quick(parser(), ["--quick", "--hops", "3"], quick)) == {"quick": True, "hops": [3],
                                                                                  "decode": 8}
    assert vars(parse_with_quick(parser(), [], quick)) == {"quick": False, "hops": [2, 3], "decode": 32}


@pytest.mark.parametrize("argv", [["--hops", "0"], ["--hops", "abc"], ["--rtt-ms", "0,-30"], ["--concurrency", "0"],
                                  ["--decode", "1"], ["--prompt", "0"], ["--rate-mbit", "-5"], ["--runs", "0"]])
def test_bench_wan_refuses_what_it_cannot_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        wan.main(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--hops", "0"], ["--rtt-ms", "x"], ["--draft", "99"], ["--decode", "1"]])
def test_bench_speculative_refuses_what_it_cannot_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        speculative.main(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--target", "nohost"], ["--target", "h:1", "--delay-ms", "-10"],
                                  ["--target", "h:1", "--delay-ms", "5", "--rate-mbit", "0"]])
def test_the_relay_refuses_a_target_without_a_port_and_negative_delays(argv: list[str],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        relay.main(["--listen", "0", *(argv if "--delay-ms" in argv else [*argv, "--delay-ms", "5"])])
    assert "error" in capsys.readouterr().err
    with pytest.raises(ValueError):
        DelayRelay("127.0.0.1", 1, -0.01)
    with pytest.raises(ValueError):
        DelayRelay("127.0.0.1", 1, 0.01, 0.0)
    with pytest.raises(ValueError):
        DelayRelay("127.0.0.1", 1, 0.01, float("nan"))
