"""The output's identity on real directories: what :class:`OutputIdentity` says when the
output, the journal directory or the journal's segment is removed or moved, including a move
that lands between two steps of its walk."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from eagle3d.run.diskguard import OutputIdentity


class _Out:
    """An output with a journal directory and an open segment, as the daemon lays it out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.out = root / "out"
        self.jdir = self.out / ".eagle3d" / "journal" / "shard-0-of-1"
        self.jdir.mkdir(parents=True)
        self.segment = self.jdir / "0000000000000000.e3j"
        self.fd = os.open(self.segment, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        #: Run once, the first time the walk asks for the segment: a change landing mid-walk.
        self.mid_walk: Callable[[], None] | None = None

    def segment_now(self) -> tuple[str, int]:
        hook, self.mid_walk = self.mid_walk, None
        if hook is not None:
            hook()
        return str(self.segment), self.fd


@pytest.fixture
def laid(tmp_path: Path) -> Iterator[tuple[_Out, OutputIdentity]]:
    o = _Out(tmp_path)
    ident = OutputIdentity(str(o.out), str(o.jdir), o.segment_now)
    yield o, ident
    ident.close()
    os.close(o.fd)


def test_nothing_changed_says_nothing(laid: tuple[_Out, OutputIdentity]) -> None:
    assert laid[1].check() == ""


def test_the_output_moved_is_named_moved(laid: tuple[_Out, OutputIdentity]) -> None:
    o, ident = laid
    o.out.rename(o.root / "moved")
    assert ident.check() == f"the output directory {o.out} was moved away during the run"


def test_the_output_removed_is_named_removed(laid: tuple[_Out, OutputIdentity]) -> None:
    o, ident = laid
    shutil.rmtree(o.out)
    assert ident.check() == f"the output directory {o.out} was removed during the run"


def test_a_move_landing_mid_walk_names_the_output_not_the_journal(
    laid: tuple[_Out, OutputIdentity],
) -> None:
    # The output and journal directories pass, then the output is moved before the segment
    # is looked at: the segment's path is gone, but what happened is the output's move.
    o, ident = laid
    o.mid_walk = lambda: o.out.rename(o.root / "moved")
    assert ident.check() == f"the output directory {o.out} was moved away during the run"


def test_the_segment_alone_moved_then_removed(laid: tuple[_Out, OutputIdentity]) -> None:
    o, ident = laid
    aside = o.jdir / "aside.e3j"
    o.segment.rename(aside)
    assert ident.check() == f"the journal {o.segment} was moved away during the run"
    aside.unlink()
    assert ident.check() == f"the journal {o.segment} was removed during the run"
