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

    def identity(self) -> OutputIdentity:
        return OutputIdentity(str(self.out), str(self.jdir), self.segment_now)


@pytest.fixture
def laid(tmp_path: Path) -> Iterator[_Out]:
    o = _Out(tmp_path)
    yield o
    os.close(o.fd)


def test_nothing_changed_says_nothing(laid: _Out) -> None:
    ident = laid.identity()
    try:
        assert ident.check() == ""
    finally:
        ident.close()


def test_the_output_moved_is_named_moved(laid: _Out) -> None:
    ident = laid.identity()
    try:
        laid.out.rename(laid.root / "moved")
        assert ident.check() == f"the output directory {laid.out} was moved away during the run"
    finally:
        ident.close()


def test_the_output_removed_is_named_removed(laid: _Out) -> None:
    ident = laid.identity()
    try:
        shutil.rmtree(laid.out)
        assert ident.check() == f"the output directory {laid.out} was removed during the run"
    finally:
        ident.close()


def test_a_move_landing_mid_walk_names_the_output_not_the_journal(laid: _Out) -> None:
    # The output and journal directories pass, then the output is moved before the segment
    # is looked at: the segment's path is gone, but what happened is the output's move.
    ident = laid.identity()
    try:
        laid.mid_walk = lambda: laid.out.rename(laid.root / "moved")
        assert ident.check() == f"the output directory {laid.out} was moved away during the run"
    finally:
        ident.close()


def test_the_segment_alone_removed_or_moved(laid: _Out) -> None:
    ident = laid.identity()
    try:
        aside = laid.jdir / "aside.e3j"
        laid.segment.rename(aside)
        assert ident.check() == f"the journal {laid.segment} was moved away during the run"
        aside.unlink()
        assert ident.check() == f"the journal {laid.segment} was removed during the run"
    finally:
        ident.close()
