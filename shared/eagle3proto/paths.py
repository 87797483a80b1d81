"""Where things live: the output layout both the daemon and monitors rely on.

``OUTPUT/rows_<g>-<g+2000>/data_<idx>.ckpt`` holds samples (SpecForge's layout), and
``OUTPUT/.eagle3d/`` holds the journal of each shard, its lock, and (by default) nothing
else, so an output directory is self-describing: ``--output`` is all a reader needs.
"""

from __future__ import annotations

import hashlib
import os
import re

import msgspec

GROUP_SIZE = 2000
STATE_DIR = ".eagle3d"
SAMPLE_SUFFIX = ".ckpt"
TMP_MARK = ".tmp-"
_SHARD_RE = re.compile(r"^shard-(\d+)-of-(\d+)$")
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107


class Shard(msgspec.Struct, frozen=True):
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: need 0 <= I < N")

    @property
    def name(self) -> str:
        return f"shard-{self.index}-of-{self.count}"

    def owns(self, idx: int) -> bool:
        return idx % self.count == self.index

    @classmethod
    def parse(cls, text: str) -> Shard:
        """Parse ``I/N``."""
        try:
            i, n = text.split("/")
            return cls(int(i), int(n))
        except ValueError as e:
            raise ValueError(f"--shard {text!r}: expected I/N with 0 <= I < N") from e


def rows_dir(idx: int) -> str:
    g = idx // GROUP_SIZE * GROUP_SIZE
    return f"rows_{g}-{g + GROUP_SIZE}"


def sample_relpath(idx: int) -> str:
    """Path of sample ``idx`` relative to the output directory."""
    return f"{rows_dir(idx)}/data_{idx}{SAMPLE_SUFFIX}"


def state_dir(output: str) -> str:
    return os.path.join(output, STATE_DIR)


def journal_root(output: str) -> str:
    return os.path.join(state_dir(output), "journal")


def journal_dir(output: str, shard: Shard) -> str:
    return os.path.join(journal_root(output), shard.name)


def staging_dir(output: str, shard: Shard) -> str:
    """Where a shard's sample files are written before their rename into ``rows_*``: the
    only folder a start lists for what a crash left (it holds at most what was committing)."""
    return os.path.join(state_dir(output), "staging", shard.name)


def lock_path(output: str, shard: Shard) -> str:
    return os.path.join(state_dir(output), f"{shard.name}.lock")


def shard_dirs(output: str) -> list[tuple[Shard, str]]:
    """Every shard journal present in an output, in shard order."""
    root = journal_root(output)
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for n in names:
        m = _SHARD_RE.match(n)
        if m:
            found.append((Shard(int(m.group(1)), int(m.group(2))), os.path.join(root, n)))
    return found


def default_socket_path(output: str, shard: Shard, env: dict[str, str] | None = None) -> str:
    """The daemon's socket: ``$RUNTIME_DIRECTORY`` (systemd), else ``$XDG_RUNTIME_DIR/eagle3d``,
    else beside the journal; a path too long for ``sun_path`` falls back to /tmp."""
    env = dict(os.environ) if env is None else env
    tag = hashlib.sha1(os.path.abspath(output).encode()).hexdigest()[:10]
    name = f"{tag}-{shard.name}.sock"
    if env.get("RUNTIME_DIRECTORY"):
        path = os.path.join(env["RUNTIME_DIRECTORY"].split(":")[0], name)
    elif env.get("XDG_RUNTIME_DIR"):
        path = os.path.join(env["XDG_RUNTIME_DIR"], "eagle3d", name)
    else:
        path = os.path.join(state_dir(os.path.abspath(output)), f"{shard.name}.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        path = os.path.join("/tmp", f"eagle3d-{name}")
    return path


def start_beacon_name(output: str, shard: Shard) -> str:
    """The Linux abstract-namespace socket a daemon serves while it starts (before its event
    socket is up): it writes no file, so a start that is refused or stopped leaves nothing
    under the output. A leading NUL is what makes a Unix socket address abstract."""
    return f"\0{_beacon_prefix(output)}{shard.name}"


def _beacon_prefix(output: str) -> str:
    tag = hashlib.sha256(os.path.abspath(output).encode()).hexdigest()[:32]
    return f"eagle3d-start/{tag}/"


def starting_shards(output: str, proc_unix: str = "/proc/net/unix") -> list[Shard]:
    """The shards of ``output`` whose daemon is starting (its start beacon listens), from
    the kernel's list of Unix sockets; [] where that list cannot be read."""
    want = "@" + _beacon_prefix(output)
    try:
        with open(proc_unix) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = set()
    for line in lines:
        name = line.rsplit(" ", 1)[-1]
        m = _SHARD_RE.match(name[len(want) :]) if name.startswith(want) else None
        if m:
            found.add(Shard(int(m.group(1)), int(m.group(2))))
    return sorted(found, key=lambda s: (s.count, s.index))
