"""Fixtures of the bench tests."""

from __future__ import annotations

import functools

import pytest

from hyprefix.bench import env


@pytest.fixture
def small_matmul_peak(monkeypatch) -> None:
    """The throughput workload's matmul-peak probe on 64 x 64 x 64 (its default is seconds of
    2048 x 2048 x 8192 matmuls): the tests check what the report does with a peak, not its value."""
    monkeypatch.setattr(env, "measure_matmul_peak", functools.partial(env.measure_matmul_peak, m=64, k=64, n=64))
