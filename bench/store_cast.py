"""What the storage cast costs: CPU per sample of the dump writer and of the commit, before
(float32 computed, float32 stored: what a CPU run wrote until the storage dtype existed) and
with bfloat16 storage, cast at the producer or in the commit.

Three variants, in interleaved rounds on the same samples (float32 states, as a CPU forward
makes them):

* ``fp32``: the producer writes a float32 dump, the commit stores float32 (the baseline);
* ``commit-cast``: a float32 dump, the commit casts to bfloat16 within its read (splice);
* ``producer-cast``: the producer casts to bfloat16 and writes that dump, the commit moves it.

Producer CPU is ``eagle3d.remote.dumpfile.write_dump`` (with ``eagle3d.remote.storedtype.cast`` before it for
``producer-cast``) into ``/dev/shm``; commit CPU is ``Committer.commit_files`` in batches of
8 (read, check, cast, checksum, direct write, fdatasync, rename, directory sync) plus the
dump's unlink, as the daemon's commit threads do, to a directory on ``--dir``'s disk. CPU is
the process's (user + system), one thread, one torch thread as in the daemon.

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/store_cast.py [--dir DIR]
        [--shapes 400x128,1024x2048] [--samples 48] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

VARIANTS = ("fp32", "commit-cast", "producer-cast")
LAYERS = [2, 4, 5]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--shapes", default="400x128,1024x2048", help="TOKENSxHIDDEN,...")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()

    import torch
    from eagle3d.remote import storedtype
    from eagle3d.remote.dumpfile import write_dump
    from eagle3d.store.committer import Committed, Committer

    torch.set_num_threads(1)
    bf16 = storedtype.FORMATS["bfloat16"]
    base = tempfile.mkdtemp(prefix="bench-store-cast-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="bench-store-cast-", dir=a.shm)
    print(
        f"store_cast: {a.samples} samples x {a.rounds} interleaved rounds per variant; "
        f"dumps in {a.shm}, output under {a.dir}; load average {os.getloadavg()[0]:.1f}"
    )
    try:
        for shape in a.shapes.split(","):
            t, h = (int(x) for x in shape.split("x"))
            g = torch.Generator().manual_seed(t * h)
            samples = [
                (torch.randn(t, 3 * h, generator=g), torch.randn(t, h, generator=g))
                for _ in range(min(a.samples, 8))
            ]
            ids = torch.randint(0, 1000, (t,))
            ids_list, mask = ids.tolist(), [1] * t
            cpu: dict[str, dict[str, list[float]]] = {
                v: {"producer": [], "commit": [], "wall": [], "bytes": []} for v in VARIANTS
            }
            for r in range(a.rounds):
                order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # each variant in each place
                for v in order:
                    dumps = os.path.join(shm, f"{v}-{r}")
                    out = os.path.join(base, f"{v}-{r}")
                    os.makedirs(dumps)
                    c = Committer(out, store=None if v == "fp32" else bf16)
                    c.warm_up()
                    c0 = time.process_time()
                    paths = []
                    dump_bytes = 0
                    for i in range(a.samples):
                        aux, hid = samples[i % len(samples)]
                        if v == "producer-cast":
                            aux, hid = storedtype.cast(aux, bf16), storedtype.cast(hid, bf16)
                        path = write_dump(dumps, f"r{i}", ids, aux, hid, LAYERS)
                        paths.append(path)
                    prod = time.process_time() - c0
                    dump_bytes = sum(os.path.getsize(q) for q in paths)
                    c0, w0 = time.process_time(), time.perf_counter()
                    for k in range(0, a.samples, 8):
                        batch = [
                            (k + j, ids_list, mask, paths[k + j])
                            for j in range(8)
                            if k + j < a.samples
                        ]
                        for (_, _, _, q), res in zip(
                            batch, c.commit_files(batch, h, LAYERS), strict=True
                        ):
                            assert isinstance(res, Committed), res
                            os.unlink(q)
                    com = time.process_time() - c0
                    wall = time.perf_counter() - w0
                    cpu[v]["producer"].append(prod / a.samples * 1e3)
                    cpu[v]["commit"].append(com / a.samples * 1e3)
                    cpu[v]["wall"].append(wall / a.samples * 1e3)
                    cpu[v]["bytes"].append(dump_bytes / a.samples)
                    shutil.rmtree(out)
                    os.rmdir(dumps)
            med = {v: {k: statistics.median(x) for k, x in d.items()} for v, d in cpu.items()}
            b = med["fp32"]
            print(
                f"\nT {t}, H {h}: dump {b['bytes'] / 1e6:.2f} MB float32; medians of "
                f"{a.rounds} rounds, ms per sample (ratio to fp32 in the same run)"
            )
            print(
                "| variant | dump writer CPU | commit CPU | commit wall | both CPU "
                "| both CPU per round, ratio (min-max) |"
            )
            print("|---|---|---|---|---|---|")
            bb = b["producer"] + b["commit"]
            for v in VARIANTS:
                m = med[v]
                both = m["producer"] + m["commit"]
                rounds = [
                    (p + c) / bb for p, c in zip(cpu[v]["producer"], cpu[v]["commit"], strict=True)
                ]
                print(
                    f"| {v} | {m['producer']:.3f} ({m['producer'] / b['producer']:.2f}) "
                    f"| {m['commit']:.3f} ({m['commit'] / b['commit']:.2f}) "
                    f"| {m['wall']:.3f} ({m['wall'] / b['wall']:.2f}) "
                    f"| {both:.3f} ({both / bb:.2f}) | {min(rounds):.2f}-{max(rounds):.2f} |"
                )
            sys.stdout.flush()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
