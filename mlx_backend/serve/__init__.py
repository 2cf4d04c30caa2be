"""The OpenAI-compatible server: mlx-lm's own, with n-gram speculation."""
