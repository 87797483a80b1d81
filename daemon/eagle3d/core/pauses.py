"""The paused areas of a run, and when a pause may end. Pure: probes are made by the shell.

A write the environment refused (a full, unwritable or failing output, journal or dump area)
pauses the run on that area. :class:`Pauses` remembers each area's fault, says which probe
writes to make and when (:meth:`Pauses.due`, every :data:`PROBE_EVERY_S` or at once on
SIGHUP), and judges their results (:meth:`Pauses.judge`): the run resumes only when every
paused area takes writes again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3d.core.envfault import DUMPS, EnvFault, may_resume

PROBE_EVERY_S = 2.0


@dataclass(frozen=True, slots=True)
class Probe:
    """A probe write to make into ``directory`` for the paused ``area``, which must then
    hold ``need`` free bytes (for a full disk)."""

    area: str
    directory: str
    need: int


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What came of a :class:`Probe`."""

    probe: Probe
    ok: bool  # the probe write succeeded
    free: int  # bytes free there
    error: str = ""  # what refused the probe ('' when it succeeded)


@dataclass(slots=True)
class Pauses:
    faults: dict[str, EnvFault] = field(default_factory=dict)  # area -> what refused a write
    reason: str = ""  # the pause's reason ('' while running): its first fault's
    next_probe: float = 0.0

    def add(self, fault: EnvFault, now: float) -> bool:
        """Pause on ``fault``'s area; True when the run was not paused before."""
        self.faults[fault.area] = fault
        self.next_probe = now + PROBE_EVERY_S
        if self.reason:
            return False
        self.reason = fault.reason
        return True

    def due(
        self, now: float, force: bool, dump_dir: str, need: int, dumps_need: int
    ) -> list[Probe]:
        """The probes to make now: ``need`` bytes in the output or the journal's area,
        ``dumps_need`` in the dump area (``dump_dir``)."""
        if not self.faults or (now < self.next_probe and not force):
            return []
        self.next_probe = now + PROBE_EVERY_S
        return [
            Probe(area, dump_dir, dumps_need) if area == DUMPS else Probe(area, f.path, need)
            for area, f in self.faults.items()
        ]

    def judge(self, results: list[ProbeResult]) -> tuple[bool, str]:
        """(whether every paused area is back, and if not why the first that is not)."""
        passed = set()
        for r in results:
            fault = self.faults.get(r.probe.area)
            if fault is None:
                continue
            if not may_resume(fault, r.ok, r.free, r.probe.need):
                return False, f"{fault.reason} ({r.error or f'{r.free} bytes free'})"
            passed.add(r.probe.area)
        if not self.faults or passed != set(self.faults):
            return False, ""
        return True, ""

    def clear(self) -> str:
        """End the pause; returns the reason the ``running`` record gives."""
        full = all(f.disk_full for f in self.faults.values())
        areas = " and ".join(f"the {a}" for a in self.faults)
        self.faults.clear()
        self.reason = ""
        return "disk space freed" if full else f"{areas} writable again"

    def areas(self) -> str:
        return " and ".join(f"the {a}" for a in self.faults)
