"""The scheduler process's heap and the cyclic garbage collector.

A full collection walks every container object the interpreter tracks. In a scheduler
that is mostly what startup made and nothing will free: the modules' functions, types and
descriptors (about 50,000 objects once numpy, msgspec and nats are imported), and the
fleet it rebuilt in its takeover. One such pass takes about 0.1 s on 100,000 objects
(``bench scheduler`` measured a full pass of 0.09-0.29 s inside a timed core call), and
it runs on the event loop, in the middle of whatever submit or KV event triggered it: a
pause every request in flight waits through.

``freeze_heap`` collects once, then moves everything that survived into the collector's
permanent generation (``gc.freeze``): later passes walk only what was made after it, the
requests in flight and what they reference. Frozen objects are still freed by reference
counting; only a cycle among them would wait for ``gc.unfreeze``, so it is done once a
process: a second scheduler in the same process (tests run many) freezes nothing more.
Called once the scheduler is settled (``SchedulerService``), and by ``bench scheduler`` at
the same point of its run, so the bench measures the core as the service runs it.
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_heap() -> int:
    """Collect, then freeze what survived, once a process; how many objects are frozen."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
