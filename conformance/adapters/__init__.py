"""Adapters that present this project's own backends through the conformance protocol
(``docs/conformance.md``): ``--backend reference`` is :mod:`.reference`, ``--backend mlx`` is :mod:`.mlx`."""
