"""What ``eagle3d plan`` found (:class:`PlanReport`): per shard, what remains to write, the
free space and the verdict, as text or JSON. Its :attr:`PlanReport.exit_code` is the exit
status of ``plan`` (:mod:`eagle3d.tools.plan`) and the verdict of ``run``'s space check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3proto.paths import Shard

from eagle3d.exitcodes import EXIT_OK, EXIT_SPACE
from eagle3d.store import pace, sizing


@dataclass(slots=True)
class ShardPlan:
    shard: Shard
    estimate: sizing.Estimate  # of what remains
    saved: int = 0  # samples the journal records as saved
    saved_bytes: int = 0
    failed: int = 0  # failed for good (not redone)
    note: str = ""  # the journal holds another job, ...
    # What reading the remaining rows as the run will found (scaled up from a sample):
    invalid: int = 0  # rows the run fails as the row's own fault (bad JSON, no turns, ...)
    over: int = 0  # rows longer than max_length (truncated, or skipped)
    skipped: int = 0  # of them, failed as too_long (--on-overflow skip)
    dropped: int = 0  # tokens truncation drops
    first_invalid: list[str] = field(default_factory=list)  # the first few, in words


@dataclass(slots=True)
class PlanReport:
    """What a plan found. :attr:`exit_code` is the documented exit status."""

    model: str
    dataset: str
    output: str
    store_dtype: str
    hidden: int
    layers: int
    max_length: int
    rows: int  # dataset rows (sample ids)
    blank: int
    tokenized: int  # rows tokenized
    sampled: bool  # a sample of the rows, not all of them
    seconds: float
    shards: list[ShardPlan]
    scope: Shard | None  # the shard the verdict is for (None: every shard)
    disk: sizing.Disk | None
    reserve: int
    bytes_per_token: float  # of the files, at this job's token counts
    problems: list[str] = field(default_factory=list)
    commit: pace.CommitPace | None = None  # the commit rate this machine's CPUs can hold
    max_failed_fraction: float = 0.05  # the run's failure rule (exit 9 above it)

    def _sum(self, key: str) -> int:
        return sum(int(getattr(s, key)) for s in self.in_scope)

    def row_problems(self) -> list[str]:
        """The rows that will not be saved, in words: the first invalid ones, and whether
        the run's failure rule will make it exit 9."""
        out = [f"invalid: {w}" for s in self.in_scope for w in s.first_invalid][:5]
        bad = self._sum("invalid") + self._sum("skipped")
        left = sum(s.estimate.rows for s in self.in_scope)
        if left and bad > self.max_failed_fraction * left:
            out.append(
                f"{bad:,} of {left:,} remaining rows will fail ({self._sum('invalid'):,} invalid,"
                f" {self._sum('skipped'):,} skipped as too long): more than"
                f" --max-failed-fraction {self.max_failed_fraction:g}, the run will exit 9"
            )
        return out

    @property
    def in_scope(self) -> list[ShardPlan]:
        return [s for s in self.shards if self.scope is None or s.shard == self.scope]

    @property
    def bytes(self) -> int:
        """What the job (or the shard in scope) still writes under the output."""
        n = sum(s.estimate.total for s in self.in_scope)
        fresh = all(s.saved == 0 for s in self.in_scope)
        return n + (sizing.JOURNAL_FIXED * len(self.in_scope) if fresh else 0)

    @property
    def bound(self) -> int:
        return int(sum(s.estimate.bound**2 for s in self.in_scope) ** 0.5)

    @property
    def fits(self) -> bool | None:
        """Whether :attr:`bytes` and the reserve fit in the free space (None: unknown)."""
        if self.disk is None:
            return None
        return self.bytes + self.reserve <= self.disk.free

    @property
    def exit_code(self) -> int:
        """0: fits (or the free space is unknown); 10: does not fit."""
        return EXIT_SPACE if self.fits is False else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        def shard(s: ShardPlan) -> dict[str, Any]:
            e = s.estimate
            return {
                "shard": s.shard.name,
                "rows": e.rows,
                "samples": e.samples,
                "tokens": e.tokens,
                "files_bytes": e.bytes,
                "bytes": e.total,
                "bound_bytes": e.bound,
                "saved_samples": s.saved,
                "saved_bytes": s.saved_bytes,
                "failed": s.failed,
                "note": s.note,
            }

        return {
            "model": self.model,
            "dataset": self.dataset,
            "output": self.output,
            "store_dtype": self.store_dtype,
            "hidden_size": self.hidden,
            "aux_layers": self.layers,
            "max_length": self.max_length,
            "rows": self.rows,
            "blank": self.blank,
            "tokenized_rows": self.tokenized,
            "sampled": self.sampled,
            "seconds": round(self.seconds, 3),
            "scope": self.scope.name if self.scope else "all",
            "bytes": self.bytes,
            "bound_bytes": self.bound,
            "samples": sum(s.estimate.samples for s in self.in_scope),
            "tokens": sum(s.estimate.tokens for s in self.in_scope),
            "bytes_per_token": round(self.bytes_per_token, 2),
            "free_bytes": self.disk.free if self.disk else None,
            "filesystem": self.disk.path if self.disk else None,
            "reserve_bytes": self.reserve,
            "fits": self.fits,
            "exit_code": self.exit_code,
            "shards": [shard(s) for s in self.shards],
            "rows_invalid": self._sum("invalid"),
            "rows_over_max_length": self._sum("over"),
            "rows_skipped": self._sum("skipped"),
            "tokens_dropped": self._sum("dropped"),
            "problems": [*self.row_problems(), *self.problems],
            "commit_bytes_per_s": round(self.commit.bytes_per_s) if self.commit else None,
            "commit_tokens_per_s": round(self.commit.tokens_per_s) if self.commit else None,
        }

    def __str__(self) -> str:
        z = sizing.size
        left = sum(s.estimate.rows for s in self.shards)
        how = (
            f"a uniform random sample of {self.tokenized:,} of the {left:,} remaining rows"
            " (95 % bounds shown)"
            if self.sampled
            else f"all {self.tokenized:,} remaining rows"
        )
        lines = [
            f"eagle3d plan {self.output}",
            f"  model {self.model}: hidden {self.hidden}, {self.layers} aux layers; states "
            f"{self.store_dtype}; max_length {self.max_length}",
            f"  dataset {self.dataset}: {self.rows:,} rows ({self.blank} blank); tokenized "
            f"{how} in {self.seconds:.1f} s",
            f"  {self.bytes_per_token:,.0f} bytes per token in the files",
        ]
        for s in self.shards:
            e = s.estimate
            pm = f" ± {z(e.bound)}" if e.bound else ""
            mark = "" if self.scope is None or s.shard == self.scope else "  (not this run's)"
            lines.append(
                f"  {s.shard.name}: {e.samples:,} samples, {e.tokens:,} tokens, "
                f"{z(e.total)}{pm} to write{mark}"
            )
            if s.saved or s.failed:
                lines.append(
                    f"    already saved {s.saved:,} ({z(s.saved_bytes)}), failed {s.failed:,}"
                    " (from the journal)"
                )
            if s.note:
                lines.append(f"    {s.note}")
        if self.scope is not None and len(self.shards) > 1:
            every = sum(s.estimate.total for s in self.shards)
            lines.append(
                f"  all {len(self.shards)} shards write {z(every)}: into one output they"
                " share its filesystem"
            )
        what = self.scope.name if self.scope is not None else "the job"
        pm = f" ± {z(self.bound)}" if self.bound else ""
        lines.append(f"  {what} writes {z(self.bytes)}{pm}; reserve {z(self.reserve)}")
        if self.commit is not None:
            lines.append(f"  {self.commit.describe()}")
        over, dropped = self._sum("over"), self._sum("dropped")
        if over:
            cut = "skipped (too_long)" if self._sum("skipped") else "truncated"
            lost = f", {dropped:,} tokens dropped" if dropped else ""
            lines.append(f"  {over:,} rows longer than max_length {self.max_length}: {cut}{lost}")
        if self._sum("invalid"):
            lines.append(f"  {self._sum('invalid'):,} invalid rows (never saved)")
        lines.extend(f"  {p}" for p in [*self.row_problems(), *self.problems])
        if self.disk is None:
            lines.append("  free space: unknown")
            lines.append("FITS? UNKNOWN")
        else:
            lines.append(f"  {self.disk.path}: {z(self.disk.free)} free of {z(self.disk.total)}")
            short = self.bytes + self.reserve - self.disk.free
            lines.append("FITS" if self.fits else f"DOES NOT FIT (short by {z(short)})")
        return "\n".join(lines)


__all__ = ["PlanReport", "ShardPlan"]
