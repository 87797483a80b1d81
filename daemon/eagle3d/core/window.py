"""The window rule: whether one more request may be sent. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from eagle3d.core.envfault import dump_room
from eagle3d.core.sample import SENT, Sample


def room(
    inflight: Iterable[Sample], in_flight: int, window: int, dump_free: int, bytes_per_token: float
) -> bool:
    """One more request may be sent while fewer than ``window`` sent requests wait at the
    producer, fewer than three windows are in flight in all (``in_flight``, committing
    included), and the dump area's ``dump_free`` bytes (-1: unknown) hold the dumps still to
    come plus one more of the mean size in flight (:func:`eagle3d.core.envfault.dump_room`).

    The window counts requests at the producer only: a sample whose dump arrived is
    committed in parallel, so a slow commit never starves the producer (this overlap is the
    point); committing samples are bounded by the three windows, to bound the dump area. A
    request the producer says it started (the HF worker) no longer waits: its batcher then
    always chooses from a full window (with the window short by the running batch, the demo
    set's batches were 70 % real tokens instead of 78 %).
    """
    waiting = sent = planned = 0
    for p in inflight:
        if p.stage == SENT:
            sent += 1
            planned += len(p.input_ids)
            waiting += not p.started
    if waiting >= window or in_flight >= 3 * window:
        return False
    if sent == 0 or dump_free < 0:
        return True
    bpt = bytes_per_token
    return dump_room(dump_free, int(planned * bpt), int(planned / sent * bpt), sent)
