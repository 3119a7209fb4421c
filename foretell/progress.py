"""Progress bars that log lines do not break: while a bar is shown, records of the console
logging handlers print through tqdm.write, above the bar, instead of into its line."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def progress_bar(total: int | None, desc: str, enabled: bool = True, unit: str = "it", **kwargs) -> Iterator:
    """A tqdm bar (a silent one when not enabled) during which logging goes through tqdm.write."""
    from tqdm import tqdm

    if not enabled:
        bar = tqdm(total=total, desc=desc, unit=unit, disable=True, **kwargs)
        try:
            yield bar
        finally:
            bar.close()
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        bar = tqdm(total=total, desc=desc, unit=unit, **kwargs)
        try:
            yield bar
        finally:
            bar.close()
