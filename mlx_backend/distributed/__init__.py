"""Speculation on a model sharded over several processes (``mlx.launch``)."""
