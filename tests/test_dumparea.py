"""The dump area's mount, as :mod:`eagle3d.dumps.area` reads it from mountinfo, and what the
daemon says about it at start."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import runkit
from eagle3d.dumps import area

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
25 24 0:23 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=24683568k
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1024k,huge=within_size
48 22 0:43 / /srv/e3d\\040dumps rw,relatime - tmpfs tmpfs rw,size=12582912k,huge=always
49 22 0:44 / /srv/advised rw,relatime - tmpfs tmpfs rw,size=1g,huge=advise
"""


@pytest.mark.parametrize(
    ("path", "mount", "fstype", "huge"),
    [
        ("/dev/shm/eagle3d-x", "/dev/shm", "tmpfs", "within_size"),  # the later mount hides
        ("/srv/e3d dumps/job", "/srv/e3d dumps", "tmpfs", "always"),  # \\040 is a space
        ("/srv/e3d", "/", "ext4", "never"),  # a prefix of a mount point is not inside it
        ("/srv/advised/x", "/srv/advised", "tmpfs", "advise"),
    ],
)
def test_the_mount_holding_a_path(path: str, mount: str, fstype: str, huge: str) -> None:
    assert area.area_of(path, MOUNTINFO) == area.Area(mount, fstype, huge)


def test_advice_only_for_a_tmpfs_in_small_pages() -> None:
    def said(path: str) -> str:
        return area.advice(path, area.area_of(path, MOUNTINFO))

    assert said("/srv/advised/x").startswith("dump area /srv/advised/x: a tmpfs in 4 KiB pages")
    assert "huge=within_size" in said("/srv/advised/x")
    assert said("/srv/e3d dumps/job") == "" and said("/dev/shm/x") == "" and said("/x") == ""
    assert area.advice("/x", None) == ""
    assert area.area_of("/x", "garbage\n") is None


def test_only_a_tmpfs_in_2_mib_pages_has_its_dumps_written_from_a_mapping() -> None:
    def huge(path: str) -> bool:
        return area.huge_pages(area.area_of(path, MOUNTINFO))

    assert huge("/srv/e3d dumps/job") and huge("/dev/shm/x")  # always, within_size
    assert not huge("/srv/advised/x") and not huge("/x") and not area.huge_pages(None)


def test_this_machines_mountinfo_is_read(tmp_path: Path) -> None:
    found = area.read(str(tmp_path))
    assert found is not None and str(tmp_path.resolve()).startswith(found.mount.rstrip("/"))
    assert area.read(str(tmp_path), mountinfo="/nonexistent") is None


def test_the_start_says_when_the_dump_area_is_in_small_pages(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A job whose dump area is a tmpfs in 4 KiB pages logs the advice at start; one on a
    disk folder does not."""
    shm = area.read("/dev/shm")
    if shm is None or shm.fstype != "tmpfs" or shm.huge not in ("never", "advise"):
        pytest.skip("/dev/shm is no tmpfs in 4 KiB pages here")
    data = tmp_path / "data.jsonl"
    valid, malformed = runkit.dataset(data, 4)
    dumps = Path("/dev/shm") / f"eagle3d-test-{tmp_path.name}"
    out = tmp_path / "out"
    try:
        r = runkit.run(tiny_model_dir, data, out, "--dump-dir", str(dumps))
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, valid, malformed)
    assert f"dump area {dumps}: a tmpfs in 4 KiB pages" in r.stderr
    assert "a dump's pages spliced into the write" in r.stderr
    r = runkit.run(tiny_model_dir, data, tmp_path / "out2")  # its dumps beside the output
    assert r.returncode == 0 and "a tmpfs in 4 KiB pages" not in r.stderr
    assert "a dump's pages spliced into the write" in r.stderr  # a disk's page cache: too


def test_a_dump_area_in_2_mib_pages_is_written_from_the_mapping(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """On a tmpfs mounted huge=within_size (mounted here where root may) the commit writes
    each dump from its mapping, says so, and says nothing about the pages."""
    import os
    import subprocess

    mnt = tmp_path / "huge"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=256m,huge=within_size", "tmpfs", str(mnt)]
    if os.geteuid() != 0 or subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        data = tmp_path / "data.jsonl"
        valid, malformed = runkit.dataset(data, 4)
        r = runkit.run(tiny_model_dir, data, tmp_path / "out", "--dump-dir", str(mnt / "d"))
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(tmp_path / "out", valid, malformed)
    assert "a dump's pages written from its mapping" in r.stderr
    assert "a tmpfs in 4 KiB pages" not in r.stderr
