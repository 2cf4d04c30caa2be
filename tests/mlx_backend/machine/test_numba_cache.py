"""numba's cache of ngram-spec's kernels is kept in the user's cache folder, never beside the modules.

Before: numba's default wrote ``__pycache__/*.nbi`` / ``*.nbc`` beside the installed modules; pip's record
lacks them, so uninstalling a ``pip install .`` left ``site-packages/mlx_backend/**/__pycache__``, an empty
namespace package that shadowed the editable install of the README's second quickstart command
(``ngram-spec --help`` outside the clone: ``No module named 'mlx_backend.ngram.dynamic_cache'``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KERNEL = """
import numpy as np
from mlx_backend.ngram.radix_sort import radix_sort
x = np.array([5, 3, 9, 1], np.int64)
radix_sort(x, 0, np.empty_like(x))
assert x.tolist() == [1, 3, 5, 9], x
"""


def _numba_files(folder: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*") if p.suffix in (".nbi", ".nbc")}


def test_kernels_are_cached_in_the_user_cache_folder_not_beside_the_modules(tmp_path):
    beside = _numba_files(ROOT / "mlx_backend")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(NGRAM_SPEC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", KERNEL], env=env, cwd=tmp_path, check=True, timeout=300)
    assert any("radix_sort" in Path(p).name for p in _numba_files(tmp_path / "cache" / "numba")), \
        sorted((tmp_path / "cache").rglob("*"))
    assert _numba_files(ROOT / "mlx_backend") == beside


def test_numba_cache_dir_set_by_the_user_is_kept(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "mine"), NGRAM_SPEC_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", KERNEL], env=env, cwd=tmp_path, check=True, timeout=300)
    assert _numba_files(tmp_path / "mine") and not (tmp_path / "cache" / "numba").exists()
