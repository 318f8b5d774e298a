"""The statistics behind `corral bench containers`: percentiles with linear interpolation and the summary."""

from __future__ import annotations

import random
import statistics

import pytest

from corral.bench.containers import percentile, summarize
from corral.bench.control_plane import _ms


def test_median_of_an_even_sample_interpolates_between_the_middle_two() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_median_of_an_odd_sample_is_the_middle_value() -> None:
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0


def test_p95_interpolates_between_closest_ranks() -> None:
    # rank = (4 - 1) * 0.95 = 2.85: 85% of the way from 3 to 4.
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85, abs=1e-12)
    # rank = (5 - 1) * 0.95 = 3.8: 80% of the way from 40 to 50.
    assert percentile([50.0, 10.0, 40.0, 20.0, 30.0], 95) == pytest.approx(48.0, abs=1e-12)


def test_quartiles_land_on_exact_ranks() -> None:
    samples = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(samples, 25) == 20.0
    assert percentile(samples, 75) == 40.0


def test_extremes_are_min_and_max() -> None:
    samples = [7.0, 3.0, 9.0, 1.0]
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 100) == 9.0


def test_a_single_sample_is_every_percentile() -> None:
    for q in (0, 1, 50, 95, 99, 100):
        assert percentile([42.0], q) == 42.0


def test_input_order_does_not_matter_and_input_is_not_modified() -> None:
    samples = [3.0, 1.0, 2.0]
    assert percentile(samples, 50) == 2.0
    assert samples == [3.0, 1.0, 2.0]


def test_agrees_with_the_inclusive_method_of_statistics_quantiles() -> None:
    samples = [random.Random(7).uniform(0.5, 80.0) for _ in range(37)]
    cut_points = statistics.quantiles(samples, n=100, method="inclusive")
    for q, expected in zip(range(1, 100), cut_points, strict=True):
        assert percentile(samples, q) == pytest.approx(expected, rel=1e-12)


def test_empty_sample_and_out_of_range_q_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="0, 100"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="0, 100"):
        percentile([1.0], -1)


def test_summary_of_a_known_sample() -> None:
    summary = summarize([4.0, 1.0, 3.0, 2.0])
    assert summary == {
        "p50": 2.5,
        "p95": pytest.approx(3.85, abs=1e-12),
        "mean": 2.5,
        "min": 1.0,
        "max": 4.0,
        "n": 4,
    }


def test_summary_of_one_sample() -> None:
    assert summarize([12.5]) == {"p50": 12.5, "p95": 12.5, "mean": 12.5, "min": 12.5, "max": 12.5, "n": 1}


def test_summary_of_an_empty_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_control_plane_latencies_never_put_p95_below_p50() -> None:
    """`corral bench control-plane` lists one job a few times: with two samples its p95 was their minimum."""
    assert _ms([0.1109, 0.0988]) == {"p50": pytest.approx(104.85), "p95": pytest.approx(110.295)}
    assert _ms([0.001 * i for i in range(1, 101)])["p95"] == pytest.approx(95.05)
