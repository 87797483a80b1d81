"""How long the SGLang capture hook holds the forward, against the forward itself (CPU).

The stand-in of SGLang's Llama forward (tests/sglang_standin.py) on a tiny model of about
h256/L8, fp32, a packed extend batch of 16 requests x 256 tokens; dumps go to a tmpfs.

* baseline: the forward with SGLang's own aux capture on and no hook (what the model costs);
* hook time: the time spent inside the hook per forward (on CPU: slicing + a host clone of
  ids, aux and final states; on GPU it is an async copy into pinned memory + event record);
* forward with hook, while the writer thread writes the dumps in the background.

    .venv/bin/python bench/sglang_hook.py [--forwards 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import sglang_standin as st  # noqa: E402
from eagle3d.remote import sglang_hook as sh  # noqa: E402
from eagle3d.remote import sglang_rid as sr  # noqa: E402
from eagle3d.tools.tinymodel import build_tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forwards", type=int, default=20)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        model_dir = build_tiny_model(
            os.path.join(tmp, "m"), layers=8, hidden=256, heads=4, kv_heads=2
        )
        g = torch.Generator().manual_seed(0)
        reqs = [torch.randint(3, 900, (a.tokens,), generator=g).tolist() for _ in range(a.requests)]

        bare, _ = st.load_standin(model_dir)
        bare.set_eagle3_layers_to_capture(None)  # same model work as with the hook
        hooked, _ = st.load_standin(model_dir)
        dumps = os.path.join(tmp, "dumps")
        cap = sh.make_hook({"dump_dir": dumps}, model=hooked, ranks=sh.Ranks())
        inside: list[float] = []

        def timed(module: object, args: tuple[object, ...], output: object) -> None:
            t = time.perf_counter()
            cap(module, args, output)
            inside.append(time.perf_counter() - t)

        hooked.model.register_forward_hook(timed)

        def forward(model: st.LlamaForCausalLM, k: int) -> float:
            items = [(sr.sglang_rid(f"f{k}-r{j}", ids), ids, 0) for j, ids in enumerate(reqs)]
            fb = st.make_batch(items, {})
            t = time.perf_counter()
            model(fb.input_ids, fb.positions, fb)
            return time.perf_counter() - t

        forward(bare, -1), forward(hooked, -1)  # warm-up
        writer = cap.writer
        assert writer is not None  # the first capture started it
        writer.drain()
        inside.clear()
        t_bare, t_hooked = [], []
        for k in range(a.forwards):  # interleaved, so load changes hit both alike
            t_bare.append(forward(bare, k))
            t_hooked.append(forward(hooked, k))
        t0 = time.perf_counter()
        writer.drain()
        tail = time.perf_counter() - t0
        written = cap.assembler.written
        mb = sum(os.path.getsize(os.path.join(dumps, f)) for f in os.listdir(dumps)) / 1e6

    med_bare, med_hooked, med_in = (statistics.median(x) for x in (t_bare, t_hooked, inside))
    ntok = a.requests * a.tokens
    print(
        f"packed batch: {a.requests} x {a.tokens} tokens, {a.forwards} forwards each, h256/L8 fp32, 1 thread"
    )
    print(
        f"forward, capture on, no hook : {med_bare * 1e3:8.1f} ms  ({ntok / med_bare:,.0f} tok/s)"
    )
    print(
        f"forward with the eagle3d hook: {med_hooked * 1e3:8.1f} ms  ratio {med_bare / med_hooked:.2f} of baseline"
    )
    print(
        f"time inside the hook         : {med_in * 1e3:8.1f} ms  = {med_in / med_bare:.1%} of the forward"
    )
    print(
        f"dumps written: {written} ({mb:.0f} MB); writer still busy {tail * 1e3:.0f} ms after the last forward"
    )


if __name__ == "__main__":
    main()
