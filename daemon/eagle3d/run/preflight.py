"""Checks made before a job starts: readable inputs, writable output, one daemon per shard.

Each failure is a :class:`Fatal` carrying the documented exit code and a message that
names the file or setting at fault.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
from collections.abc import Iterator

from eagle3proto import locks, paths

from eagle3d.exitcodes import EXIT_INPUT, EXIT_LOCKED, EXIT_OUTPUT, Fatal

#: Weight files a Hugging Face model folder has (one of them, or shards an index names).
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: Tokenizer files a fast tokenizer loads from (one set of them).
TOKENIZER_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def check_model(model: str, weights: bool = True) -> None:
    """The model folder holds what the run loads, checked as metadata before anything is
    written: ``config.json`` (valid JSON), the weights (``weights``: the HF backend loads
    them; an SGLang server has its own) and the tokenizer's files. Names what is missing."""
    if not os.path.isdir(model):
        raise Fatal(EXIT_INPUT, f"model directory {model}: not found")
    cfg = os.path.join(model, "config.json")
    if not os.access(cfg, os.R_OK):
        raise Fatal(EXIT_INPUT, f"model directory {model}: no readable config.json")
    try:
        with open(cfg, "rb") as f:
            json.loads(f.read())
    except (ValueError, OSError) as e:
        raise Fatal(EXIT_INPUT, f"model directory {model}: config.json unreadable: {e}") from e
    names = set(os.listdir(model))
    missing = []
    if weights and not (names & set(WEIGHTS) or any(n.endswith(".safetensors") for n in names)):
        missing.append("the weights (model.safetensors, *.safetensors or pytorch_model.bin)")
    if not any(all(n in names for n in group) for group in TOKENIZER_SETS):
        missing.append("the tokenizer (tokenizer.json, tokenizer.model, or vocab.json+merges.txt)")
    if missing:
        raise Fatal(EXIT_INPUT, f"model directory {model}: missing {' and '.join(missing)}")


def check_dataset(dataset: str) -> str:
    """The dataset is a file of a format eagle3d reads; returns the format's name."""
    from eagle3d.ingest.dataformats import HINT, DatasetError, detect

    if os.path.isdir(dataset):
        raise Fatal(EXIT_INPUT, f"dataset {dataset}: is a directory; give one file: {HINT}")
    if not os.path.isfile(dataset):
        raise Fatal(EXIT_INPUT, f"dataset {dataset}: not found")
    try:
        fmt = detect(dataset)
        if not _has_a_row(dataset, fmt):
            raise Fatal(EXIT_INPUT, f"dataset {dataset}: empty (no rows, only blank lines)")
        return fmt.name
    except DatasetError as e:
        hint = "" if HINT in str(e) else f"; {HINT}"
        raise Fatal(EXIT_INPUT, f"dataset {dataset}: {e}{hint}") from e
    except OSError as e:
        raise Fatal(EXIT_INPUT, f"dataset {dataset}: unreadable ({e.strerror})") from e


def _has_a_row(dataset: str, fmt: object) -> bool:
    """Whether the dataset has a row that is not blank (stops at the first one)."""
    from eagle3d.ingest.dataformats import Format, iter_rows

    assert isinstance(fmt, Format)
    return any(not isinstance(row, bytes) or row.strip() for _, row in iter_rows(dataset, fmt))


@contextlib.contextmanager
def layout_lock(output: str) -> Iterator[None]:
    """Held while the shard layout is checked and this shard's journal is created."""
    make_dirs(paths.state_dir(output))
    fd = os.open(
        os.path.join(paths.state_dir(output), "layout.lock"),
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        LOCK_MODE,
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


#: A lock file: the owner's alone (an flock needs only a descriptor: whoever can open the
#: file can hold it).
LOCK_MODE = 0o600
#: A folder eagle3d makes: the owner's; the group may read; others nothing.
DIR_MODE = 0o750


def make_dirs(path: str) -> None:
    """``os.makedirs`` with :data:`DIR_MODE` for every folder it makes (not only the last)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) and parent != path:
        make_dirs(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)


def check_output_reachable(output: str) -> None:
    """Before anything is written: the output (or the folder it would be made in) is a
    folder this process may write to, on a writable filesystem. Writes nothing."""
    p = os.path.abspath(output)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    why = ""
    if not os.path.isdir(p):
        why = os.strerror(errno.ENOTDIR)
    elif os.statvfs(p).f_flag & os.ST_RDONLY:
        why = os.strerror(errno.EROFS)
    elif not os.access(p, os.W_OK | os.X_OK):
        why = os.strerror(errno.EACCES)
    if why:
        raise Fatal(EXIT_OUTPUT, f"output {output}: not writable ({why})")


def share_with_group(output: str, gid: int) -> None:
    """With ``--group``: the output and every folder under it (``.eagle3d`` included) belong
    to ``gid`` with the setgid bit, so every folder and file made there later belongs to it
    too (the kernel gives a new entry its setgid parent's group); the files already under
    ``.eagle3d`` (journal, checkpoint, capture.json) are given to it. Sample files an earlier
    run wrote without the group keep theirs (docs/operations.md: ``chgrp -R``). Symlinks are
    never followed. ``gid`` -1: nothing to do."""
    if gid < 0:
        return
    make_dirs(paths.state_dir(output))
    _give(output, gid, is_dir=True)
    _share_tree(output, gid, files=False)


def _share_tree(top: str, gid: int, *, files: bool) -> None:
    """Every folder under ``top`` (and, with ``files``, every file) given to ``gid``."""
    with os.scandir(top) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                _give(e.path, gid, is_dir=True)
                _share_tree(e.path, gid, files=files or e.name == paths.STATE_DIR)
            elif files and e.is_file(follow_symlinks=False):
                _give(e.path, gid, is_dir=False)


def _give(path: str, gid: int, *, is_dir: bool) -> None:
    """``path`` to group ``gid``; a folder also setgid (its mode otherwise kept)."""
    st = os.lstat(path)
    if st.st_gid != gid:
        os.chown(path, -1, gid, follow_symlinks=False)
    if is_dir and not st.st_mode & stat.S_ISGID:
        os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_ISGID)


def check_output(output: str, gid: int = -1) -> None:
    """The output directory exists (or is created) and accepts a file; with ``gid`` (from
    ``--group``) it and its folders belong to that group (:func:`share_with_group`)."""
    try:
        make_dirs(output)
        share_with_group(output, gid)
        probe = os.path.join(output, f".eagle3d-write-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise Fatal(EXIT_OUTPUT, f"output {output}: not writable ({e.strerror})") from e


class ShardLock:
    """An exclusive flock on the shard's lock file, held for the daemon's lifetime.

    The file holds the owner's pid and host, so a refused second daemon can say who owns it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def acquire(self) -> None:
        make_dirs(os.path.dirname(self.path))
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, LOCK_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise Fatal(EXIT_LOCKED, f"{lock_holder_words(self.path)}; lock {self.path}") from e
            raise
        os.fchmod(fd, LOCK_MODE)  # one made 0644 by an older version: the owner's alone now
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def lock_holder_words(path: str) -> str:
    """Who holds the lock at ``path``, from ``/proc/locks`` (never from the file's text,
    which names the last daemon, alive or not)."""
    held = locks.holders(path)
    if not held:
        return "another process is running this shard"
    who = ", ".join(locks.describe(p) for p in held)
    if all(locks.is_eagle3d(p) for p in held):
        return f"another eagle3d daemon is running this shard: {who}"
    return f"this shard's lock is held by {who}, which is no eagle3d daemon"


def is_locked(path: str) -> bool:
    """True when a live process holds the lock at ``path`` (used by monitors)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
