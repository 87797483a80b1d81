"""The output's shard layouts at start: may this shard count run, and what is already settled.

:func:`survey` reads every journal of another shard count under the output (read-only)
with its lock's state; :func:`check` refuses a start the rule of
:mod:`eagle3d.core.reshard` forbids (exit 7, before anything is written; ``--force-resume``
does not override it); :func:`check_job` refuses a layout change that also changes the job
(the dataset, the model, the layers: exit 6, as a resume would).
"""

from __future__ import annotations

from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journalread import replay
from eagle3proto.paths import Shard

from eagle3d.core.reshard import OtherJournal, refusal
from eagle3d.core.sample import PENDING
from eagle3d.exitcodes import EXIT_FINGERPRINT, EXIT_LAYOUT, Fatal
from eagle3d.run import job, preflight


def _owner(lock: str) -> str:
    try:
        with open(lock, "rb") as f:
            return f.read(200).decode(errors="replace").strip()
    except OSError:
        return ""


def survey(output: str, shard: Shard, fold: bool = True) -> list[OtherJournal]:
    """Every journal of another shard count under ``output``: its lock, and (``fold``, when
    no lock is held: a live daemon refuses the start anyway) its records folded."""
    others, dirs = [], []
    for s, jdir in paths.shard_dirs(output):
        if s.count == shard.count:
            continue
        lock = paths.lock_path(output, s)
        o = OtherJournal(s, locked=preflight.is_locked(lock))
        if o.locked:
            o.owner = _owner(lock)
        others.append(o)
        dirs.append(jdir)
    if not fold or any(o.locked for o in others):
        return others
    for o, jdir in zip(others, dirs, strict=True):
        replay(jdir, o.sink)
    return others


def check(output: str, shard: Shard, fold: bool = True) -> list[OtherJournal]:
    """:func:`survey`, refused with exit 7 when a daemon of another layout may still write
    (without ``fold``, only a live one: the cheap look before anything is written)."""
    others = survey(output, shard, fold)
    why = refusal(shard, others)
    if why:
        raise Fatal(EXIT_LAYOUT, f"output {output}: {why}")
    return others


def check_job(others: list[OtherJournal], new: ev.JobInfo, force: bool) -> str:
    """The job of the other layouts' last sessions against this one's: '' when the same,
    the differences when ``force``; raises Fatal(EXIT_FINGERPRINT) otherwise."""
    diffs: list[str] = []
    for o in others:
        last = o.last_started
        if last is None:
            continue
        for k in job.COMPARED:
            d = f"{k}: {getattr(last.job, k)!r} -> {getattr(new, k)!r}"
            if getattr(last.job, k) != getattr(new, k) and d not in diffs:
                diffs.append(d)
    if not diffs or force:
        return "; ".join(diffs)
    names = ", ".join(o.shard.name for o in others if o.last_started is not None)
    raise Fatal(
        EXIT_FINGERPRINT,
        f"{new.output} holds journals of another shard count ({names}) for a different job"
        f" ({'; '.join(diffs)}); refusing to take it over (use --force-resume to override)",
    )


def pending(status: bytearray, shard: Shard) -> bool:
    """Whether a row of ``shard`` is still to do."""
    return any(status[i] == PENDING for i in range(shard.index, len(status), shard.count))


def describe(others: list[OtherJournal], shard: Shard, taken: int) -> str:
    """One log line on a layout change ('' when the output holds no other layout)."""
    if not others:
        return ""
    counts = sorted({o.shard.count for o in others})
    saved = sum(len(o.saved) for o in others)
    failed = sum(len(o.failed) for o in others)
    return (
        f"shard count changed to {shard.count} (journals of {', '.join(map(str, counts))}"
        f" shard(s) here: {saved} saved, {failed} failed); {shard.name} leaves the {taken}"
        " of its rows they settled to them and takes the rest"
    )


__all__ = ["check", "check_job", "describe", "pending", "survey"]
