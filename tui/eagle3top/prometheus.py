"""``eagle3-top --once --format prometheus`` and ``--textfile PATH``: the Prometheus text
exposition format (version 0.0.4), written by hand so ``--once`` stays light.

Every job series carries ``output``, ``host`` and ``shard`` labels: one series per shard and
no aggregate beside them, so ``sum(eagle3d_samples_saved_total)`` is the job's total. Disk and GPU series are per host
(``fs`` and ``gpu`` labels). The state is a labelled gauge: one series per state word, 1 for
the current one. Counters only grow within a journal (``sent`` counts attempts, ``dumped``
dumps that arrived for them); they restart from the journal's own count, never from zero,
when the daemon restarts.

``--textfile`` writes the same text to a temporary file in the target's directory (hidden,
so node_exporter's ``*.prom`` glob never reads it half-written), fsyncs it and renames it
over the target, the atomic write the textfile collector asks for.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from .model import HEALTH_STATES, LEVEL_WORDS
from .once import Counts, OnceDoc

#: (name, type, help, value of a Counts document or None to leave the sample out)
_JOB_METRICS: list[tuple[str, str, str, object]] = [
    ("eagle3d_samples_saved_total", "counter", "Samples durably committed.", "saved"),
    ("eagle3d_samples_failed_total", "counter", "Samples recorded as failed for good.", "failed"),
    (
        "eagle3d_samples_sent_total",
        "counter",
        "Attempts sent to the producer (retries included).",
        "requests",
    ),
    (
        "eagle3d_samples_dumped_total",
        "counter",
        "Dumps that arrived for attempts sent.",
        "dumps",
    ),
    ("eagle3d_bytes_saved_total", "counter", "Bytes of sample files committed.", "bytes_saved"),
    ("eagle3d_tokens_saved_total", "counter", "Tokens in the samples committed.", "tokens_saved"),
    (
        "eagle3d_samples_truncated_total",
        "counter",
        "Samples saved cut to the job's max_length.",
        "truncated",
    ),
    (
        "eagle3d_tokens_dropped_total",
        "counter",
        "Tokens the truncated samples lost.",
        "tokens_dropped",
    ),
    ("eagle3d_samples", "gauge", "Samples in the job (shard); absent while unknown.", "total"),
    ("eagle3d_samples_in_flight", "gauge", "Samples sent, no dump yet.", "in_flight"),
    (
        "eagle3d_samples_committing",
        "gauge",
        "Samples whose dump arrived, not saved yet.",
        "committing",
    ),
    ("eagle3d_samples_remaining", "gauge", "Samples neither saved nor failed.", "remaining"),
    ("eagle3d_saved_ratio", "gauge", "Saved over total (0 to 1).", "percent"),
    (
        "eagle3d_rate_samples_per_second",
        "gauge",
        "Samples saved per second over the last minute, since the producer came up.",
        "rate_samples_s",
    ),
    (
        "eagle3d_rate_tokens_per_second",
        "gauge",
        "Tokens saved per second over the last minute.",
        "rate_tokens_s",
    ),
    (
        "eagle3d_rate_bytes_per_second",
        "gauge",
        "Bytes committed per second over the last minute.",
        "rate_bytes_s",
    ),
    (
        "eagle3d_eta_seconds",
        "gauge",
        "Seconds left at the ETA's rate; absent while unknown, frozen while work is stopped.",
        "eta_s",
    ),
    (
        "eagle3d_eta_frozen",
        "gauge",
        "1 when the ETA is frozen (paused, stopped, producer or daemon down).",
        "eta_frozen",
    ),
    (
        "eagle3d_last_record_age_seconds",
        "gauge",
        "Age of the newest journal record.",
        "age_s",
    ),
]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**kw: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in kw.items()) + "}"


def _num(x: float | int | bool) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    return repr(float(x))


def _value(c: Counts, key: object) -> float | int | None:
    v = getattr(c, str(key))
    if key == "percent":
        return float(v) / 100.0
    if key == "eta_frozen":
        return 1 if v else 0
    return None if v is None else float(v) if isinstance(v, float) else int(v)


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seen: set[str] = set()

    def family(self, name: str, kind: str, help_: str) -> None:
        if name in self._seen:
            return
        self._seen.add(name)
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: str, value: float | int | bool) -> None:
        self.lines.append(f"{name}{labels} {_num(value)}")


def exposition(doc: OnceDoc) -> str:
    """The whole document as Prometheus text: job series per shard, then hosts."""
    out = _Out()
    output = doc.shards[0].output if doc.shards else ""
    host = doc.shards[0].host if len({s.host for s in doc.shards}) == 1 and doc.shards else ""
    # One series per shard and no aggregate beside them (Prometheus' convention): the job's
    # total is sum(...) over the shards.
    job: list[tuple[str, Counts]] = [
        (_labels(output=s.output or output, host=s.host, shard=s.label), s) for s in doc.shards
    ]
    if not job:  # nothing found: the verdict (unknown) still has a series
        job.append((_labels(output=output, host=host, shard=""), doc))
    for name, kind, help_, key in _JOB_METRICS:
        out.family(name, kind, help_)
        for labels, c in job:
            v = _value(c, key)
            if v is not None:
                out.sample(name, labels, v)
    out.family(
        "eagle3d_state",
        "gauge",
        "1 for the state the monitor judges the shard (or job) to be in, 0 for the others.",
    )
    states = (*HEALTH_STATES, "unknown")
    states_of = [s.state for s in doc.shards] or [doc.state]
    for (labels, _), state in zip(job, states_of, strict=True):
        for st in states:
            out.sample("eagle3d_state", labels[:-1] + f',state="{st}"}}', st == state)
    out.family(
        "eagle3d_status",
        "gauge",
        "The verdict as a monitoring-plugins code: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.",
    )
    codes = {w: c for c, w in LEVEL_WORDS.items()}
    levels_of = [s.level for s in doc.shards] or [doc.level]
    for (labels, _), level in zip(job, levels_of, strict=True):
        out.sample("eagle3d_status", labels, codes[level])
    out.family("eagle3d_daemon_up", "gauge", "1 when the shard's daemon runs, 0 when it does not.")
    out.family("eagle3d_producer_up", "gauge", "1 when the shard's producer is up.")
    for (labels, _), s in zip(job, doc.shards, strict=False):
        if s.alive is not None:
            out.sample("eagle3d_daemon_up", labels, s.alive)
        if s.producer_up is not None:
            out.sample("eagle3d_producer_up", labels, bool(s.producer_up and s.alive))
    _hosts(out, doc)
    return "\n".join(out.lines) + "\n"


def _hosts(out: _Out, doc: OnceDoc) -> None:
    """The per-host metrics (disks, GPUs).

    Long: a table of metrics (name, help, field) per host resource, then the loops that
    write them; the table is most of it."""
    disk = [
        ("eagle3d_disk_total_bytes", "Size of the filesystem.", "total_bytes"),
        ("eagle3d_disk_free_bytes", "Bytes an unprivileged writer can still use.", "free_bytes"),
        (
            "eagle3d_disk_projected_bytes",
            "Bytes the rest of the job still needs at the mean sample size (output only).",
            "projected_bytes",
        ),
    ]
    for name, help_, key in disk:
        out.family(name, "gauge", help_)
        for d in doc.disk:
            v = getattr(d, key)
            if v is not None:
                out.sample(name, _labels(host=d.host, fs=d.label, path=d.path), v)
    gpu: list[tuple[str, str, str, str]] = [
        ("eagle3d_gpu_utilization_ratio", "gauge", "GPU utilisation (0 to 1).", "util_percent"),
        ("eagle3d_gpu_memory_used_bytes", "gauge", "GPU memory in use.", "mem_used_bytes"),
        ("eagle3d_gpu_memory_total_bytes", "gauge", "GPU memory in all.", "mem_total_bytes"),
        ("eagle3d_gpu_temperature_celsius", "gauge", "GPU temperature.", "temperature_c"),
        ("eagle3d_gpu_power_watts", "gauge", "GPU power draw.", "power_w"),
        ("eagle3d_gpu_power_limit_watts", "gauge", "GPU enforced power limit.", "power_limit_w"),
        (
            "eagle3d_gpu_ecc_uncorrected_errors",
            "gauge",
            "Uncorrected ECC errors since the driver loaded.",
            "ecc_errors",
        ),
        (
            "eagle3d_gpu_ecc_corrected_errors",
            "gauge",
            "Corrected ECC errors since the driver loaded.",
            "ecc_corrected",
        ),
        (
            "eagle3d_gpu_xid_errors_total",
            "counter",
            "Critical XID events seen since the daemon started.",
            "xid_errors",
        ),
        ("eagle3d_gpu_last_xid", "gauge", "Code of the newest XID event (0: none).", "last_xid"),
    ]
    for name, kind, help_, key in gpu:
        out.family(name, kind, help_)
        for g in doc.gpus:
            v = getattr(g, key)
            if key == "util_percent":
                v = v / 100.0
            out.sample(name, _labels(host=g.host, gpu=str(g.index), name=g.name), v)
    out.family(
        "eagle3d_gpu_throttled",
        "gauge",
        "1 for each clock throttle reason NVML reports as active.",
    )
    for g in doc.gpus:
        for reason in g.throttle:
            out.sample(
                "eagle3d_gpu_throttled",
                _labels(host=g.host, gpu=str(g.index), reason=reason),
                1,
            )


def write_textfile(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a hidden temp file beside it, fsync, rename."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; node_exporter may run as another user
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
