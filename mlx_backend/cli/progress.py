"""Progress bars for long work: the callback ``progress(done, total)`` that the n-gram functions of
both backends call, drawn as a tqdm bar on stderr (shown only on a terminal, unless asked)."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def add_option(parser: argparse.ArgumentParser) -> None:
    """``--no-progress`` (``args.no_progress``): no bar even on a terminal."""
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")


def bar(desc: str, unit: str, show: bool | None = None) -> Callable[[int, int], None] | None:
    """A ``progress(done, total)`` callback drawing a tqdm bar named ``desc`` (``unit``: ``"tok"``,
    ``"B"``); ``show``: ``None`` on a terminal only, ``True`` always, ``False`` no callback at all.
    The bar opens at the first call and closes once ``done`` reaches ``total``."""
    if show is False:
        return None
    from tqdm import tqdm

    drawn = []

    def progress(done: int, total: int) -> None:
        if not drawn:
            drawn.append(tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, leave=False,
                              disable=None if show is None else not show))
        drawn[0].update(done - drawn[0].n)
        if done >= total:
            drawn[0].close()

    return progress
