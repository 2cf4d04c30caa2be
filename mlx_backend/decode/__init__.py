"""Speculative decoding of mlx-lm models: the step, verification and exact rollback, sampling, the draft-length policy."""
