"""Running test work on several threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def run_in_threads(work: Callable[[Any], None], args: Iterable[Any]) -> list[BaseException]:
    """Run ``work(a)`` on one thread per ``a``, all at once; return what they raised."""
    errors: list[BaseException] = []

    def run(a: Any) -> None:
        try:
            work(a)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
