"""Repository-wide pytest settings: ``__main__`` modules are entry points, not doctest material."""

collect_ignore_glob = ["*/__main__.py"]
