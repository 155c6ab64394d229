"""Progress bars on long work (downloads, weight loading, kernel builds, benchmarks).

One place decides how they look: tqdm on standard error, shown only where that is a
terminal (``disable=None``), so logs, pipes and tests stay free of bar redraws."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress_bar(iterable: Iterable[T] | None = None, *, total: float | None = None, desc: str = "",
                 disable: bool | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar over ``iterable`` (or updated by hand); ``disable`` None: on a terminal only."""
    return tqdm(iterable, total=total, desc=desc, disable=disable, dynamic_ncols=True, **kwargs)
