"""eagle3d.run.commits: a commit thread's batch, journaled, then its dumps to the reaper.

Real pieces: dumps written by the dump writer, the Committer, a journal (JournalWriter) behind
the Recorder, the output's identity, the reaper; the journal is read back from disk by the
independent reader at the moment each dump is removed.
"""

from __future__ import annotations

import os
from pathlib import Path

import crashcheck
import pytest
import torch
from eagle3d.core import outcome as oc
from eagle3d.core.sample import CommitJob
from eagle3d.remote.dumpfile import write_dump
from eagle3d.run import diskguard
from eagle3d.run import reaper as rp
from eagle3d.run.commits import commit_batch
from eagle3d.run.reaper import Reaper
from eagle3d.run.recorder import Recorder
from eagle3d.store.committer import Committer
from eagle3proto import paths
from eagle3proto.journal import JournalWriter

H, LAYERS, T = 16, [1, 2, 3], 8


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.out = tmp / "out"
        self.dumps = tmp / "dumps"
        self.dumps.mkdir()
        self.committer = Committer(str(self.out))
        self.jdir = str(self.out / ".journal")
        os.makedirs(self.jdir)
        self.journal = JournalWriter(self.jdir)
        self.journal.open()
        self.faults: list[object] = []
        self.recorder = Recorder(
            self.journal, self.faults.append, diskguard.Reserve(self.jdir + "/.reserve")
        )
        self.identity = diskguard.OutputIdentity(str(self.out), self.jdir, self.journal.segment)

    def sample(self, idx: int, nan: bool = False) -> CommitJob:
        aux = torch.randn(T, len(LAYERS) * H)
        if nan:
            aux[1, 2] = float("nan")
        path = write_dump(
            str(self.dumps), f"r-{idx}", torch.arange(T), aux, torch.randn(T, H), LAYERS
        )
        ids = list(range(T))
        return CommitJob(f"r-{idx}", idx, ids, [1] * T, False, 0, path, os.path.getsize(path))

    def saved_in_journal(self) -> set[int]:
        recs = crashcheck.read_journal(self.jdir).records
        return {r["idx"] for r in recs if r.get("kind") == "sample_saved"}

    def close(self) -> None:
        self.identity.close()
        self.journal.close()


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    s = Setup(tmp_path)
    yield s  # type: ignore[misc]
    s.close()


def test_a_dump_is_removed_once_and_only_after_its_record_is_durable(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = [setup.sample(i) for i in range(5)]
    bad = setup.sample(5, nan=True)
    removed: list[tuple[str, set[int]]] = []
    real = rp._unlink

    def spy(path: str) -> None:
        # At this instant the journal on disk already holds the sample's record.
        removed.append((path, setup.saved_in_journal()))
        real(path)

    monkeypatch.setattr(rp, "_unlink", spy)
    reaper = Reaper()
    results = commit_batch(
        [*batch, bad], setup.committer, setup.recorder, setup.identity, H, LAYERS, reaper
    )
    reaper.close()
    assert [type(r) for r in results] == [oc.Saved] * 5 + [oc.BadDump]
    by_path = {p.dump_path: p.idx for p in batch}
    assert sorted(path for path, _ in removed) == sorted(by_path)  # once each, the bad one kept
    for path, journaled in removed:
        assert by_path[path] in journaled
    # The bad dump stays for the ledger (its RemoveDump effect, once the failure is judged).
    assert os.listdir(setup.dumps) == [os.path.basename(bad.dump_path)]


def test_a_batch_the_journal_refuses_keeps_its_dumps(setup: Setup) -> None:
    batch = [setup.sample(i) for i in range(3)]
    setup.journal.close()  # the journal now refuses every record
    reaper = Reaper()
    results = commit_batch(
        batch, setup.committer, setup.recorder, setup.identity, H, LAYERS, reaper
    )
    reaper.close()
    assert all(isinstance(r, oc.NotRecorded) for r in results), results
    assert setup.faults, "the refusal is reported"
    # Nothing journaled, so nothing removed: the commit is redone from these dumps.
    assert sorted(os.listdir(setup.dumps)) == sorted(os.path.basename(p.dump_path) for p in batch)
    assert (reaper.removed, reaper.inline) == (0, 0)
    # And no sample file stands without its record: the files written are taken back.
    for p in batch:
        assert not (setup.out / paths.sample_relpath(p.idx)).exists()
