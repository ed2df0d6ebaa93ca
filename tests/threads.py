"""Run a test's worker on several threads and collect what any of them raised."""

import threading
from collections.abc import Callable


def run_threads(work: Callable[[int], None], n: int) -> list[BaseException]:
    """Call ``work(t)`` for t in range(n) on n threads; return the exceptions they raised."""
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors
