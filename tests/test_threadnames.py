"""Thread names as the kernel shows them (``/proc/self/task/TID/comm``)."""

from __future__ import annotations

import threading

from eagle3d.remote.threadnames import COMM_LEN, kernel_name, name_this_thread, name_threads


def _comm(tid: int | None) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def test_each_live_thread_gets_its_python_name_once_and_the_main_thread_keeps_its_own() -> None:
    main_before = _comm(threading.main_thread().native_id)
    release = threading.Event()
    started = []
    for name in ("commit_7", "a-very-long-thread-name", "ThreadPoolExecutor-3_1"):
        t = threading.Thread(target=release.wait, name=name, daemon=True)
        t.start()
        started.append(t)
    try:
        assert name_threads() >= 3
        assert [_comm(t.native_id) for t in started] == ["commit_7", "a-very-long-thr", "pool-3_1"]
        assert _comm(threading.main_thread().native_id) == main_before
        assert name_threads() == 0  # nothing new since
        late = threading.Thread(target=release.wait, name="late", daemon=True)
        late.start()
        assert name_threads() == 1 and _comm(late.native_id) == "late"
    finally:
        release.set()


def test_kernel_names_are_ascii_and_fit_the_kernel_limit() -> None:
    assert kernel_name("feeder") == "feeder"
    assert len(kernel_name("x" * 40)) == COMM_LEN
    assert kernel_name("jörnal") == "j?rnal"


def test_a_thread_can_name_itself_and_no_other() -> None:
    main_before = _comm(threading.main_thread().native_id)
    got: list[tuple[bool, str]] = []

    def run() -> None:
        ok = name_this_thread("e3d-dump-writer")
        got.append((ok, _comm(threading.get_native_id())))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == [(True, "e3d-dump-writer")]
    assert _comm(threading.main_thread().native_id) == main_before
