"""Suffix drafting on arrays: :mod:`reference.suffix.drafter`'s rule with "latest end" hash indexes
(:mod:`mlx_backend.suffix.index`), the drafter and the shared history (:mod:`mlx_backend.suffix.drafter`)."""
