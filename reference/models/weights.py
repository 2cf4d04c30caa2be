"""A model's named weight arrays, with errors that name the missing tensor and the directory."""
from __future__ import annotations

import numpy as np


class Weights:
    """``weights[name]`` -> array; ``group(prefix)`` -> the tensors under ``prefix``, addressed without it."""

    def __init__(self, arrays: dict[str, np.ndarray], source: str, prefix: str = ""):
        self.arrays, self.source, self.prefix = arrays, source, prefix

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise ValueError(f"{self.source}: weight {self.prefix + name!r} is missing (is this an mlx-lm model "
                             "directory of the architecture named in config.json?)") from None

    def get(self, name: str) -> np.ndarray | None:
        """An optional tensor (a bias), or None."""
        return self.arrays.get(name)

    def group(self, prefix: str) -> "Weights":
        """The tensors under ``prefix``, named without it (errors still name the full tensor)."""
        found = {k[len(prefix):]: v for k, v in self.arrays.items() if k.startswith(prefix)}
        return Weights(found, self.source, self.prefix + prefix)
