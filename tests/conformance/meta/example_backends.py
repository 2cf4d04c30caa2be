"""Backends named by ``module.path:object`` in the CLI tests (``PYTHONPATH=tests/conformance/meta``)."""
from types import SimpleNamespace

from reference.ngram.api import NgramDrafter


class TruncatingDrafter(NgramDrafter):
    """Drops the last token of every draft longer than one token: a wrong stopping rule."""

    def draft(self, n_draft):
        drafts = super().draft(n_draft)
        return drafts[:-1] if len(drafts) > 1 else drafts


drafter_only = SimpleNamespace(NgramDrafter=NgramDrafter)  # provides one protocol member
truncating = SimpleNamespace(NgramDrafter=TruncatingDrafter)
