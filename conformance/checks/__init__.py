"""The checks, one module per area; importing this package registers them (:mod:`conformance.registry`)."""
from conformance.checks import (  # noqa: F401
    cache_files,
    counts,
    drafting,
    greedy,
    replay,
    rollback,
    sampling,
    suffix,
    thresholds,
)
from conformance.registry import Check, registered


def all_checks() -> list[Check]:
    """Every check, in area order then definition order."""
    return registered()
