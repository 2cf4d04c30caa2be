"""What this machine offers and keeps: the BLAS that serves mlx, the user's cache directory."""
