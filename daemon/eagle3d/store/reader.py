"""Read what eagle3d wrote: one sample file, or every committed sample of an output.

:func:`load_sample` returns a sample file's tensors as they are stored
(``input_ids [T]``, ``loss_mask [T]``, ``hidden_state [1, T, H]``,
``aux_hidden_state [1, T, 3H]``), with both states in bfloat16 (or ``dtype``) whatever the
file's storage format: fp8 files (``--store-dtype fp8``) are dequantized with their
per-token scales (:mod:`eagle3d.store.fp8`), the others cast.

:class:`HiddenStates` is a ``torch.utils.data.Dataset`` over an output directory: its
samples are the ones the journals say are committed (:mod:`eagle3d.store.catalog`), in sample-id
order, never what a directory listing happens to show (a temp file, a file moved aside by
``verify --repair``, a sample of an older session that was redone). It reads the journals
once, when made; :meth:`HiddenStates.refresh` reads them again (an output still growing).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

from eagle3d.remote import recipes
from eagle3d.store import catalog, fp8


def load_sample(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, *, mmap: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors of the sample file at ``path``, states in ``dtype``."""
    raw = torch.load(path, mmap=mmap, weights_only=True)
    if not isinstance(raw, dict) or not {"input_ids", *fp8.STATES} <= set(raw):
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{path}: not an eagle3d sample file (keys {keys})")
    return fp8.dequantize_states(raw, dtype)


def load_record(
    path: str | os.PathLike[str], recipe: str = "eagle3", dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The sample at ``path`` as SpecForge v0.3.0's ``prepare_hidden_states.py --strategy``
    would have written it for ``recipe`` (:mod:`eagle3d.remote.recipes`): EAGLE-3's
    ``aux_hidden_state``/``hidden_state``; DFlash's and Domino's ``hidden_states``; DSpark's
    ``hidden_states`` and ``target_last_hidden_states``. The output's recipe is in its
    capture contract (``OUTPUT/.eagle3d/capture.json``) and :attr:`HiddenStates.recipe`."""
    s = load_sample(path, dtype)
    r = recipes.get(recipe)
    return r.record(s["input_ids"], s["loss_mask"], s["aux_hidden_state"], s["hidden_state"])


class HiddenStates(Dataset[dict[str, Any]]):
    """The committed samples of an eagle3d output, as the journals list them.

    Item ``i`` is the ``i``-th committed sample in sample-id order: its
    :func:`load_sample` tensors plus ``idx`` (the sample id: the dataset row). Raises
    :class:`eagle3d.store.catalog.NoJournal` for a directory without an eagle3d journal."""

    def __init__(self, output: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16):
        self.output = os.fspath(output)
        self.dtype = dtype
        self.refresh()

    def refresh(self) -> None:
        """Read the journals again: samples committed since are added."""
        self.catalog = catalog.read(self.output)
        self.entries = self.catalog.entries
        job = self.catalog.job
        #: The output's recipe (eagle3d.remote.recipes); its items stay in eagle3d's layout,
        #: :func:`load_record` gives the recipe's.
        self.recipe = (job.recipe if job is not None else "") or recipes.DEFAULT

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict[str, Any]:
        entry = self.entries[i]
        sample: dict[str, Any] = load_sample(self.catalog.path(entry), self.dtype)
        sample["idx"] = entry.idx
        return sample


__all__ = ["HiddenStates", "load_record", "load_sample"]
