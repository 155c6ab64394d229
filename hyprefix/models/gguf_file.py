"""``gguf.GGUFReader`` reading its metadata from a plain array view of the file's mapping."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader


class GGUFFile(GGUFReader):
    """A ``gguf.GGUFReader`` whose ``data`` is a plain ``ndarray`` view of its ``np.memmap``.

    The reader slices ``data`` twice for every string of the metadata, and each slice of an
    ``np.memmap`` runs the subclass's finalizer: for a vocabulary of tens of thousands of
    tokens and merges that is most of the time a file takes to open. The view maps the
    same pages (the memmap stays alive as its base), so fields and tensors are the same."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain_data = mapped.view(np.ndarray)
