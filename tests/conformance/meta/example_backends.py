"""Backends named by ``module.path:object`` in the CLI tests (``PYTHONPATH=tests/conformance/meta``)."""
import json
from pathlib import Path
from types import SimpleNamespace

import conformance.adapters.reference as reference
from reference.ngram.api import NgramDrafter


class TruncatingDrafter(NgramDrafter):
    """Drops the last token of every draft longer than one token: a wrong stopping rule."""

    def draft(self, n_draft):
        drafts = super().draft(n_draft)
        return drafts[:-1] if len(drafts) > 1 else drafts


drafter_only = SimpleNamespace(NgramDrafter=NgramDrafter)  # provides one protocol member
truncating = SimpleNamespace(NgramDrafter=TruncatingDrafter)


def _llama_only_load_model(model_dir):
    """The reference's models, refusing every architecture but llama the protocol's way."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    if model_type != "llama":
        raise NotImplementedError(f"this backend supports only llama, not {model_type}")
    return reference.load_model(model_dir)


def _no_model_load_model(model_dir):
    raise NotImplementedError("no architecture yet")


_MODEL_MEMBERS = ("NgramDrafter", "generate_step", "make_cache", "forward", "keep")
# a port that runs llama models only (sliding-window layers included), and one that runs none yet
llama_only = SimpleNamespace(load_model=_llama_only_load_model, **{n: getattr(reference, n) for n in _MODEL_MEMBERS})
no_models = SimpleNamespace(load_model=_no_model_load_model, **{n: getattr(reference, n) for n in _MODEL_MEMBERS})
