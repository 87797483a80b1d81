"""Dumps nobody asked for: removed, journaled, and counted (for the ``stats`` record)."""

from __future__ import annotations

import os

from eagle3proto import events as ev

from eagle3d.remote.dumpfile import rid_of
from eagle3d.run.recorder import Recorder


class Orphans:
    """Removes a dump of this run that no request in flight asked for (a late dump of an
    abandoned request, one an earlier run left), and journals that it did."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.count = 0

    def remove(self, path: str, reason: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        self.count += 1
        self.recorder.append(ev.DumpOrphan(rid=rid_of(path) or "", path=path, reason=reason))
