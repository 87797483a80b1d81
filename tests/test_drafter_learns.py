"""The pure parts of ``bench/drafter_learns.py`` (issue #30), run as the program it is: the
control copies keep every sample's token ids and loss mask and give it another sample's
states, cut or repeated to its length; the accuracy counts only masked positions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "drafter_learns.py"
LENGTHS = [5, 9, 3, 7]
H = 4


def bench(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def states(i: int, t: int, width: int) -> torch.Tensor:
    """Rows that name their sample and token: row j of sample i is ``100 * i + j``."""
    return (100 * i + torch.arange(t, dtype=torch.float32))[:, None].expand(t, width).clone()


def assert_donor_rows(got: torch.Tensor, own: int, t: int) -> int:
    """``got`` ([t, width]) is another sample's rows 0, 1, ... repeated from its start;
    that sample's index."""
    donor = int(got[0, 0]) // 100
    assert donor != own
    n = LENGTHS[donor]
    want = states(donor, n, got.shape[1])[torch.arange(t) % n]
    assert torch.equal(got, want)
    return donor


def test_specforge_control_keeps_ids_and_masks_and_moves_states(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "rows_0-2000").mkdir(parents=True)
    for i, t in enumerate(LENGTHS):
        torch.save(
            {
                "input_ids": torch.arange(t) + 10 * i,
                "loss_mask": (torch.arange(t) % 2 == i % 2).long(),
                "hidden_state": states(i, t, H)[None],
                "aux_hidden_state": states(i, t, 3 * H)[None],
            },
            src / "rows_0-2000" / f"data_{i}.ckpt",
        )
    assert bench("shuffle-specforge", str(src), str(dst), "--seed", "3").strip() == "4"
    donors = []
    for i, t in enumerate(LENGTHS):
        a = torch.load(src / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        b = torch.load(dst / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert b["hidden_state"].shape == (1, t, H)
        assert b["aux_hidden_state"].shape == (1, t, 3 * H)
        d = assert_donor_rows(b["hidden_state"][0], i, t)
        assert assert_donor_rows(b["aux_hidden_state"][0], i, t) == d
        donors.append(d)
    assert sorted(donors) == list(range(len(LENGTHS)))  # a permutation: every sample donates once
    # The same seed, the same control.
    again = tmp_path / "again"
    bench("shuffle-specforge", str(src), str(again), "--seed", "3")
    for i in range(len(LENGTHS)):
        a = torch.load(dst / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        b = torch.load(again / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert torch.equal(a["hidden_state"], b["hidden_state"])


def test_speculators_control_keeps_token_ids_and_the_dataset(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "hidden_states").mkdir(parents=True)
    (src / "dataset_info.json").write_text('{"rows": 4}')
    for i, t in enumerate(LENGTHS):
        layers = states(i, t, 6 * H).reshape(t, 6, H)
        save_file(
            {"token_ids": torch.arange(t) + 10 * i, "hidden_states": layers},
            str(src / "hidden_states" / f"hs_{i}.safetensors"),
        )
    assert bench("shuffle-speculators", str(src), str(dst)).strip() == "4"
    assert (dst / "dataset_info.json").read_text() == '{"rows": 4}'
    for i, t in enumerate(LENGTHS):
        b = load_file(str(dst / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(b["token_ids"], torch.arange(t) + 10 * i)
        assert b["hidden_states"].shape == (t, 6, H)
        assert_donor_rows(b["hidden_states"].reshape(t, 6 * H), i, t)


def test_accuracy_counts_masked_positions_only() -> None:
    out = json.loads(bench("accuracy", "1,2,3,4,5", "1,0,3,4,9", "1,1,0,1,1"))
    assert out == {"correct": 2, "counted": 4}
