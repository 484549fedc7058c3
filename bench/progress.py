"""A progress bar on stderr: tqdm where installed, else a one-line fallback."""
from __future__ import annotations

import sys


class _Plain:
    def __init__(self, total: int):
        self.total, self.done, self.label = total, 0, ""

    def set_description(self, label: str) -> None:
        self.label = label
        self._draw()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] "
                         f"{self.done}/{self.total} {self.label[:50]:<50}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def bar(total: int):
    """An object with set_description(str), update(n) and close()."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(total)
    return tqdm(total=total, unit="op", file=sys.stderr, dynamic_ncols=True)
