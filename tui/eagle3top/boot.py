"""What a monitor process does before anything else: imported first by :mod:`.cli`.

Both are start time that every ``eagle3-top`` call pays, a health check's above all: the
lock table's read (:func:`eagle3proto.locks.read_early`) sleeps through a kernel grace
period, so it begins here and passes while the imports run; and msgspec is imported
without ``typing_extensions``.
"""

import sys

from eagle3proto import locks


def _import_msgspec_lean() -> None:
    """Import msgspec without ``typing_extensions`` (unless something already loaded either).

    msgspec takes ``get_type_hints`` from ``typing_extensions`` when it can import it, and
    that import (with ``inspect``, ``ast``, ``dis``) is ~12 ms of a ~35 ms ``--once``: a
    third of the monitor's start beyond the interpreter's. The contract's types use only
    ``typing``'s forms, which ``typing.get_type_hints`` (msgspec's fallback) resolves the
    same on Python 3.11+. The module is blocked only while msgspec loads: anything that
    imports ``typing_extensions`` afterwards (Textual, for the TUI) gets it as usual.
    """
    if "msgspec" in sys.modules or "typing_extensions" in sys.modules:
        return
    sys.modules["typing_extensions"] = None  # type: ignore[assignment]
    try:
        import msgspec  # noqa: F401
    finally:
        del sys.modules["typing_extensions"]


locks.read_early()
_import_msgspec_lean()
