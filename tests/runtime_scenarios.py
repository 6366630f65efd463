"""Helpers of the runtime's tests in threads of one process."""

from __future__ import annotations

import faulthandler
import sys
import threading


def _together(rts, fn, timeout=30):
    """``fn(rt)`` on every runtime at once (collectives block until all live ranks joined); results by rank. A call
    still running after ``timeout`` seconds fails the test, with every thread's stack printed."""
    out: dict[int, object] = {}

    def run(rt):
        try:
            out[rt.rank] = fn(rt)
        except Exception as exc:  # returned, to be asserted on
            out[rt.rank] = exc

    threads = [threading.Thread(target=run, args=(rt,)) for rt in rts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
    assert not any(t.is_alive() for t in threads), f"a call hung: {sorted({rt.rank for rt in rts} - set(out))}"
    return out
