"""``RequestOutput.tpot`` on plain data: seconds per output token after the first, over the
longest sequence, None where it is not defined, and the server's histogram of it."""

from __future__ import annotations

import pytest

from hyprefix.outputs import CompletionOutput, RequestMetrics, RequestOutput


def output(lengths: list[int], first: float | None = 10.5, done: float | None = 12.5) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=10.0, first_token_time=first, finished_time=done)
    samples = [CompletionOutput(i, "", [7] * n, "length") for i, n in enumerate(lengths)]
    return RequestOutput("r", None, [1, 2], samples, done is not None, 0, metrics)


def test_tpot_is_decode_seconds_over_the_longest_sequence_less_its_first_token():
    assert output([5]).tpot == pytest.approx(2.0 / 4)
    assert output([3, 9, 2]).tpot == pytest.approx(2.0 / 8)


@pytest.mark.parametrize("out", [output([1]), output([]), output([4], done=None), output([4], first=None)])
def test_tpot_is_none_without_two_tokens_or_before_it_finished(out):
    assert out.tpot is None


def test_server_metrics_observe_each_finished_requests_tpot_once():
    from hyprefix.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: {}, "m")
    metrics.observe([output([5], done=None), output([3, 9]), output([1])])
    value = metrics.registry.get_sample_value
    assert value("hyprefix:time_per_output_token_seconds_count", {"model_name": "m"}) == 1
    assert value("hyprefix:time_per_output_token_seconds_sum", {"model_name": "m"}) == pytest.approx(2.0 / 8)
