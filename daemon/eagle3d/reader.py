"""The reader's public name, as issue #21 fixes it: ``eagle3d.reader.load_sample(path)`` and
the journal-driven ``eagle3d.reader.HiddenStates`` dataset. The code is
:mod:`eagle3d.store.reader`."""

from __future__ import annotations

from eagle3d.store.reader import HiddenStates, load_record, load_sample

__all__ = ["HiddenStates", "load_record", "load_sample"]
