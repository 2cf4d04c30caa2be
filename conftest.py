"""Repository-wide pytest settings: ``__main__`` modules are entry points, not doctest material."""

collect_ignore_glob = ["*/__main__.py"]

import os
from pathlib import Path

import pytest

# numba's machine code for this checkout's kernels (mlx_backend/machine/numba_cache.py would put it in the
# user's cache folder): kept beside the tests, shared by the commands they start, warm from run to run.
# Set before anything imports numba, which reads it then.
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parent / ".numba-cache"))


@pytest.fixture(autouse=True, scope="session")
def _isolated_machine_state(tmp_path_factory):
    """Tests keep learned step costs out of the user's cache directory, and commands they start
    (``ngram-spec generate`` / ``demo``) keep mlx's bundled BLAS: no test depends on OpenBLAS."""
    saved = {k: os.environ.get(k) for k in ("NGRAM_SPEC_CACHE_DIR", "NGRAM_SPEC_BLAS")}
    os.environ["NGRAM_SPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("ngram-spec-cache"))
    os.environ["NGRAM_SPEC_BLAS"] = "bundled"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
