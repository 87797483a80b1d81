#!/usr/bin/env python3
"""The naive serial script a user would write instead of the daemon: one process, one sample
at a time (chat template, forward, ``torch.save``, fsync, next). The baseline of
``bench/short_job.py``.

    python bench/serial_extract.py --model M --dataset D --output DIR [--threads N]

Prints one JSON line: samples saved, and the seconds until the model was loaded and until the
last file was synced (from the process start).
"""

from __future__ import annotations

import argparse
import json
import os
import time

T0 = time.monotonic()


def _turn(m: dict[str, str]) -> dict[str, str]:
    """A ShareGPT turn (from/value) as a chat-template message (role/content)."""
    if "from" not in m:
        return m
    role = {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"])
    return {"role": role, "content": m["value"]}


def _encode(tok: object, row: dict[str, object]) -> list[int]:
    """The chat template's token ids for a conversation row (messages or conversations)."""
    msgs = row.get("messages") or row.get("conversations")
    assert isinstance(msgs, list)
    text = tok.apply_chat_template([_turn(m) for m in msgs], tokenize=False)  # type: ignore[attr-defined]
    return list(tok(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.threads:
        torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    aux = [2, n // 2, n - 3]  # what eagle3d captures by default (SGLang's choice)
    loaded = time.monotonic() - T0
    os.makedirs(a.output, exist_ok=True)
    saved = 0
    with open(a.dataset, encoding="utf-8") as f:
        for i, line in enumerate(f):
            try:
                row = json.loads(line)
                if "input_ids" in row:  # pre-tokenized: used as it is, as the daemon does
                    ids = [int(x) for x in row["input_ids"]]
                    if not ids:
                        continue
                else:
                    ids = _encode(tok, row)
            except Exception:
                continue  # a malformed line: the daemon fails it too
            with torch.inference_mode():
                out = model(torch.tensor([ids]), output_hidden_states=True)
            hs = out.hidden_states
            sample = {
                "input_ids": torch.tensor(ids),
                "loss_mask": torch.ones(len(ids), dtype=torch.long),
                "hidden_state": hs[-1][0].clone(),
                "aux_hidden_state": torch.cat([hs[k + 1][0] for k in aux], dim=-1),
            }
            path = os.path.join(a.output, f"data_{i}.ckpt")
            with open(path, "wb") as fh:
                torch.save(sample, fh)
                fh.flush()
                os.fsync(fh.fileno())
            saved += 1
    print(json.dumps({"saved": saved, "loaded_s": loaded, "done_s": time.monotonic() - T0}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
