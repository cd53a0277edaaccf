"""bench/cpu_steal.py: the steal share the failover benchmarks report beside their figures."""

from __future__ import annotations

from bench.cpu_steal import CpuSampler, cpu_times, steal_share
from bench.failover import steal_band


def times(steal: int, total: int) -> list[int]:
    """Counters with `steal` ticks of steal among `total` (the rest user time), guest fields after."""
    return [total - steal, 0, 0, 0, 0, 0, 0, steal, 99, 99]


def test_steal_is_a_share_of_all_cpu_time_between_two_readings() -> None:
    assert steal_share(times(10, 1000), times(60, 1200)) == 25.0  # 50 of 200 ticks
    assert steal_share(times(10, 1000), times(10, 1000)) is None  # no time passed
    assert steal_share(None, times(1, 2)) is None
    now = cpu_times()
    assert now is None or len(now) >= 8


def test_a_window_takes_the_readings_inside_it() -> None:
    cpu = CpuSampler()
    cpu.at = [0.0, 1.0, 2.0, 3.0]
    cpu.times = [times(0, 0), times(0, 200), times(100, 400), times(100, 600)]
    assert cpu.steal_pct(1.0, 2.0) == 50.0
    assert cpu.steal_pct(2.0, 3.5) == 0.0
    assert cpu.steal_pct() == round(100 * 100 / 600, 1)
    assert cpu.steal_pct(3.0, 3.0) is None  # one reading: no span


def test_kills_fall_in_steal_bands() -> None:
    assert [steal_band(p) for p in (0.0, 9.9, 10.0, 19.9, 20.0, 55.0, None)] == [
        "steal < 10 %", "steal < 10 %", "steal 10-20 %", "steal 10-20 %", "steal >= 20 %", "steal >= 20 %",
        "steal unknown"]
