"""The compatibility matrix (docs/compatibility.md, made by ``python -m mlx_backend.models.compat``):
it lists every architecture of the installed mlx-lm with a verdict and, where the verdict is not
"identical", a reason; and rerunning the check on representative architectures (full attention,
sliding window, chunked, GatedDeltaNet, other linear attention, Mamba, a CacheList of SSM and
attention) reproduces its rows."""
from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from mlx_backend.models.compat import (MAX_TOKENS, OVERRIDES, PROMPT, VERDICTS, architectures, build,
                                       check, tiny_config)
from mlx_backend.decode.generate import SpecStats, ngram_speculative_generate_step

DOC = Path(__file__).resolve().parents[3] / "docs" / "compatibility.md"
REPRESENTATIVE = ["llama", "gemma3_text", "llama4", "qwen3_5", "olmo_hybrid", "mamba", "falcon_h1"]


@functools.cache
def committed_rows() -> dict[str, dict]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1] in VERDICTS:
            rows[cells[0]] = dict(verdict=cells[1], caches=cells[2], rollback=cells[3], detail=cells[5])
    return rows


def test_matrix_covers_every_architecture_of_the_installed_mlx_lm():
    assert f"mlx-lm {mlx_lm.__version__}" in DOC.read_text()
    rows = committed_rows()
    assert sorted(rows) == architectures()
    for arch, row in rows.items():
        assert row["verdict"] not in ("DIVERGES", "error"), (arch, row)
        if row["verdict"] != "identical":
            assert row["detail"], f"{arch}: verdict {row['verdict']} without a reason"


@pytest.mark.parametrize("arch", REPRESENTATIVE)
def test_rerun_reproduces_the_committed_row(arch):
    row = check(arch)
    assert row["verdict"] == "identical", row
    assert 0 < row["accepted"] < row["drafted"]          # drafts accepted and rejected
    committed = committed_rows()[arch]
    assert (committed["verdict"], committed["caches"], committed["rollback"]) == \
        (row["verdict"], row["caches"], row["rollback"])


def test_measured_default_policy_on_a_sliding_window_model():
    """The matrix gives the policy a fixed cost curve; here the default measures it (its verify
    forwards run on the model's own rotating caches, window 8 < the 32-token fill)."""
    model = build("gemma3_text")
    plain = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS,
                                              sampler=lambda x: mx.argmax(x, axis=-1))]
    stats = SpecStats()
    spec = [t for t, _, _ in ngram_speculative_generate_step(mx.array(PROMPT), model,
                                                             max_tokens=MAX_TOKENS, stats=stats)]
    assert spec == plain and stats.policy["cost_rel"]


@pytest.mark.parametrize("arch", ["hunyuan", "gemma3n", "talkie"])
def test_architectures_that_had_no_tiny_config_are_checked(arch):
    """Before: "no tiny config". hunyuan's RoPE reads rope_scaling['alpha'] and gemma3n's layers read
    per-layer lists (their OVERRIDES entries give them, as a real config.json does); talkie's output
    matrix is a bare array, which the randomizer did not find. gemma3n's KV-shared layers read a sliding-
    window cache the verify forward had not written (mlx_backend.decode.rollback), a shape error."""
    row = check(arch)
    assert row["verdict"] == "identical", row
    assert 0 < row["accepted"] < row["drafted"]
    assert committed_rows()[arch]["verdict"] == "identical"


def test_every_override_names_an_architecture_and_configs_name_their_module():
    assert set(OVERRIDES) <= set(architectures())
    import mlx_lm.models.hunyuan as hunyuan
    assert tiny_config(hunyuan)["model_type"] == "hunyuan"     # before: "" (the required field's guess)


@pytest.mark.skipif(mx.metal.is_available(), reason="Metal runs the kernel")
def test_a_metal_only_architecture_names_the_file_of_its_kernel():
    row = check("bitnet")
    assert row["verdict"] == "plain fails" and "mlx_lm/models/bitlinear_layers.py" in row["detail"], row
