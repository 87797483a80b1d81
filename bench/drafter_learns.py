"""Issue #30: a drafter learns from eagle3d's output (not CI).

A tiny target (10 layers, H=64) is first trained briefly on the demo's train conversations
(plain causal-LM loss; a random-init target's next-token distribution is nearly flat, and
nothing can be learned from it). eagle3d extracts it (HF backend): EAGLE-3 (layers 2,5,7)
and DFlash (layers 1,3,5,7,9, exported for speculators), the train and the held-out
conversations (every 5th) apart. A control copy of each train output holds the states of
another sample (a seeded derangement; same token ids and loss masks; the donor's states cut,
or repeated from its start, to the sample's length; every state, the last one the teachers
are computed from included). Then SpecForge 0.2.0's EAGLE-3 trainer (``specforge train``)
and speculators 0.9.0's DFlash trainer (``speculators.train.cli.main``) run the same steps
with the same seed on the real and on the control data, and each drafter predicts from the
held-out conversations' real states: the accuracy of its first draft position (top-1
against the actual token, at the positions its trainer trains that position on), beside
the target's own top-1 at the same positions (what a drafter can at best agree with).

* EAGLE-3 (SpecForge): at position t the draft sees the states of token t and the embedding
  of token t+1 and predicts token t+2; counted where ``loss_mask[t]`` and t+2 < T (its
  trainer's position mask for step 0).
* DFlash (speculators): supervised positions a < T-4 are anchors (a seeded sample of
  :data:`ANCHORS` a sample); the block's first masked slot predicts token a+1; counted where
  ``loss_mask[a+1]`` (its aligned mask).

What runs differently from a GPU: SpecForge's fused Triton loss runs in plain torch (the
same expression, :class:`TorchSoftmaxLoss`: Triton's CPU interpreter takes ~10 s a step
here, torch 0.1 s; the losses agree within 1e-5), speculators' Trainer gets the CPU as its
accelerator (as in tests/test_speculators_train.py), and ``torch.compile`` is disabled
(``TORCHDYNAMO_DISABLE``: minutes of C++ compilation on a CPU for the same operations).

Run from the repository root, in SpecForge's environment (``scripts/specforge_env``), with
eagle3d's own environment for the extraction (``.venv``); about 18 minutes on the 2 shared
cores::

    PYTHONPATH=shared:daemon:tui nice -n 10 .venv-specforge/bin/python bench/drafter_learns.py \\
        [--work DIR] [--json FILE] [--target-steps 400] [--draft-steps 300] [--seed 0] [--reuse]

Subcommands used by the run and by ``tests/test_drafter_learns.py`` (programs, not imports):
``shuffle-specforge SRC DST`` / ``shuffle-speculators SRC DST`` write a control copy;
``accuracy PRED ACTUAL MASK`` prints the accuracy of comma-separated ids.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "daemon" / "eagle3d" / "data" / "demo.jsonl"
EAGLE3_LAYERS = [2, 5, 7]  # eagle3d's default for 10 layers: [2, L//2, L-3]
DFLASH_LAYERS = [1, 3, 5, 7, 9]
BLOCK = 4
#: Anchors per held-out sample in the DFlash evaluation (a seeded sample of its supervised
#: positions where it has more): every anchor costs a block of the draft's attention.
ANCHORS = 64
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "CUDA_VISIBLE_DEVICES": "",
    # Small forwards on a shared machine: a second thread mostly waits at barriers.
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    # torch.compile on a CPU compiles C++ for minutes at the start of each trainer; eager
    # runs the same operations.
    "TORCHDYNAMO_DISABLE": "1",
}


# -- pure parts ---------------------------------------------------------------------------


def split_lines(lines: list[str], every: int) -> tuple[list[str], list[str]]:
    """(train, held-out): every ``every``-th parseable line is held out; unparseable ones
    (the demo's deliberately malformed line) go nowhere."""
    train: list[str] = []
    held: list[str] = []
    for line in lines:
        try:
            json.loads(line)
        except json.JSONDecodeError:
            continue
        (held if (len(train) + len(held)) % every == 0 else train).append(line)
    return train, held


def derangement(n: int, seed: int) -> list[int]:
    """A seeded permutation of ``range(n)`` with no fixed point (``n >= 2``): sample i takes
    the states of sample ``perm[i]``, never its own."""
    if n < 2:
        raise ValueError("a derangement needs at least two samples")
    rng = random.Random(seed)
    while True:
        perm = list(range(n))
        rng.shuffle(perm)
        if all(i != p for i, p in enumerate(perm)):
            return perm


def fit_tokens(states: Any, length: int, dim: int) -> Any:
    """``states`` cut, or repeated from its start, to ``length`` tokens along ``dim``."""
    import torch

    n = states.shape[dim]
    index = torch.arange(length) % n
    return states.index_select(dim, index).contiguous()


def accuracy(pred: Any, actual: Any, mask: Any) -> tuple[int, int]:
    """(correct, counted): positions where ``mask`` is set and ``pred == actual``."""
    m = mask.bool()
    return int(((pred == actual) & m).sum()), int(m.sum())


# -- the control copies -------------------------------------------------------------------


def shuffle_specforge(src: Path, dst: Path, seed: int) -> int:
    """Copy an eagle3d output's ``.ckpt`` files (SpecForge's EAGLE-3 record) to ``dst`` with
    each sample's ``hidden_state`` and ``aux_hidden_state`` taken from another sample."""
    import torch

    files = sorted(src.glob("rows_*/data_*.ckpt"))
    perm = derangement(len(files), seed)
    for f, p in zip(files, perm, strict=True):
        d = torch.load(f, weights_only=True)
        donor = torch.load(files[p], weights_only=True)
        t = d["input_ids"].shape[0]
        for k in ("hidden_state", "aux_hidden_state"):
            d[k] = fit_tokens(donor[k], t, 1)
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(d, out)
    return len(files)


def shuffle_speculators(src: Path, dst: Path, seed: int) -> int:
    """Copy a speculators export to ``dst`` with each row's ``hidden_states`` (every layer
    and the last state) taken from another row; ids, masks and the dataset unchanged."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("hs_*.safetensors", ".eagle3d-*"))
    files = sorted((src / "hidden_states").glob("hs_*.safetensors"), key=_row)
    perm = derangement(len(files), seed)
    for f, p in zip(files, perm, strict=True):
        d = load_file(str(f))
        donor = load_file(str(files[p]))
        d["hidden_states"] = fit_tokens(donor["hidden_states"], d["token_ids"].shape[0], 0)
        save_file(d, str(dst / "hidden_states" / f.name))
    return len(files)


def _row(path: Path) -> int:
    return int(path.stem.split("_")[1])


# -- the steps ----------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def eagle3d(*args: str) -> None:
    exe = ROOT / ".venv" / "bin" / "eagle3d"
    r = subprocess.run([str(exe), *args], env=ENV, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"eagle3d {args[0]} exited {r.returncode}:\n{r.stderr[-3000:]}")


def logged(cmd: list[str], path: Path, env: dict[str, str]) -> str:
    """Run ``cmd`` with its output in the file ``path`` (to follow it); that output."""
    with path.open("w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    out = path.read_text()
    if rc != 0:
        raise SystemExit(f"{Path(cmd[1]).name} exited {rc} (see {path}):\n{out[-3000:]}")
    return out


def encode_lines(model: Path, lines: list[str]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each line, as eagle3d's own encoder makes them."""
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataset import BadSample, parse_line

    enc = ChatEncoder.from_pretrained(str(model))
    out = []
    for i, line in enumerate(lines):
        try:
            t = enc.encode(parse_line(i, line))
        except BadSample:
            continue
        out.append((t.input_ids, t.loss_mask))
    return out


def train_target(model: Path, train: list[str], held: list[str], a: Any) -> dict:
    """Train the tiny target in place on ``train`` (causal-LM loss on every token of
    ``--windows`` windows of ``--window`` tokens cut from the train conversations laid end to end, AdamW, one
    cycle); its held-out next-token accuracy and perplexity before and after."""
    import torch
    from eagle3d.tools.tinymodel import _write_index
    from transformers import AutoModelForCausalLM

    torch.manual_seed(a.seed)
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    tr, he = encode_lines(model, train), encode_lines(model, held)
    before = lm_eval(m, he)
    stream = torch.tensor([t for ids, _ in tr for t in ids])
    opt = torch.optim.AdamW(m.parameters(), lr=a.target_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.target_lr, total_steps=a.target_steps)
    gen = torch.Generator().manual_seed(a.seed)
    m.train()
    for step in range(a.target_steps):
        starts = torch.randint(0, stream.numel() - a.window, (a.windows,), generator=gen)
        ids = torch.stack([stream[s : s + a.window] for s in starts.tolist()])
        loss = m(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0:
            log(f"target step {step}: loss {loss.item():.3f}")
    m.eval()
    after = lm_eval(m, he)
    m.save_pretrained(str(model))
    _write_index(model, "model.safetensors")
    return {
        "before": before,
        "after": after,
        "steps": a.target_steps,
        "train": len(tr),
        "held": len(he),
    }


def lm_eval(m: Any, data: list[tuple[list[int], list[int]]]) -> dict:
    """Next-token accuracy (all tokens, and answer tokens) and perplexity of a causal LM."""
    import math

    import torch

    c_all = n_all = c_ans = n_ans = 0
    nll = 0.0
    with torch.no_grad():
        for ids, mask in data:
            x = torch.tensor([ids])
            logits = m(input_ids=x).logits[0, :-1]
            y = x[0, 1:]
            nll += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            hit = logits.argmax(-1) == y
            c_all += int(hit.sum())
            n_all += y.numel()
            ans = torch.tensor(mask[1:]).bool()
            c_ans += int((hit & ans).sum())
            n_ans += int(ans.sum())
    return {
        "accuracy": c_all / n_all,
        "answer_accuracy": c_ans / max(n_ans, 1),
        "perplexity": math.exp(nll / n_all),
    }


def extract(model: Path, data: Path, out: Path, recipe: str, layers: list[int]) -> None:
    eagle3d(
        "run",
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--recipe",
        recipe,
        "--layers",
        ",".join(map(str, layers)),
        "--max-failed-fraction",
        "0.5",
    )


# -- SpecForge's EAGLE-3 -------------------------------------------------------------------


def specforge_files(work: Path, cfg: dict) -> Path:
    """A one-layer EAGLE-3 draft config of the target's width and full vocabulary."""
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "num_hidden_layers": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "vocab_size": cfg["vocab_size"],
        "draft_vocab_size": cfg["vocab_size"],
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }
    path = work / "eagle3-draft.json"
    path.write_text(json.dumps(draft, indent=2))
    return path


def specforge_train(work: Path, model: Path, draft: Path, data: Path, name: str, a: Any) -> Path:
    """``specforge train`` (its own CLI) for ``a.draft_steps`` steps; its last checkpoint."""
    yaml = f"""model:
  target_model_path: {model}
  draft_model_config: {draft}
  aux_hidden_state_layer_ids: {[i - 1 for i in EAGLE3_LAYERS]}
data:
  hidden_states_path: {data}
  max_length: {a.max_length}
  dataloader_num_workers: 0
training:
  strategy: eagle3
  batch_size: 1
  num_epochs: 100
  max_steps: {a.draft_steps}
  learning_rate: {a.lr}
  ttt_length: {a.ttt_length}
  seed: {a.seed}
  save_interval: {a.draft_steps}
  fsdp_sharding: NO_SHARD
  attention_backend: sdpa
  log_interval: 25
output_dir: {work / name}
"""
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml)
    env = {**ENV, "SPECFORGE_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, __file__, "specforge-train", "--config", str(cfg)]
    out = logged(cmd, work / f"{name}.log", env)
    steps = re.findall(r"^step (\d+): (\{.*\})$", out, re.M)
    if steps:
        log(f"{name}: last step {steps[-1][0]}: {steps[-1][1][:200]}")
    (ckpt,) = sorted((work / name).glob("*-step*/training_state.pt"))[-1:]
    return ckpt


def target_accuracy(model: Path, held: Path) -> dict[str, dict[str, Any]]:
    """The target's own top-1 at the positions each drafter is scored on, from the held-out
    output's last (post-norm) states and the target's ``lm_head``: token t+2 from the state
    of t+1 where ``loss_mask[t]`` (EAGLE-3's first position), token a+1 from the state of a
    where ``loss_mask[a]`` and ``loss_mask[a+1]``, a < T-4 (DFlash's first slot, every
    anchor)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        head = f.get_tensor("lm_head.weight")
    e = [0, 0]
    d = [0, 0]
    for path in sorted(held.glob("rows_*/data_*.ckpt")):
        rec = torch.load(path, weights_only=True)
        ids, mask = rec["input_ids"], rec["loss_mask"]
        t = ids.shape[0]
        pred = (rec["hidden_state"][0].float() @ head.T).argmax(-1)
        if t >= 3:
            c, n = accuracy(pred[1 : t - 1], ids[2:], mask[: t - 2])
            e = [e[0] + c, e[1] + n]
        anchor = mask.clone()
        anchor[-BLOCK:] = 0
        c, n = accuracy(pred[:-1], ids[1:], anchor[:-1] * mask[1:])
        d = [d[0] + c, d[1] + n]
    return {
        "eagle3": {"correct": e[0], "counted": e[1], "accuracy": e[0] / e[1]},
        "dflash": {"correct": d[0], "counted": d[1], "accuracy": d[0] / d[1]},
    }


class TorchSoftmaxLoss:
    """SpecForge's EAGLE-3 loss (``specforge.core.loss``: the target-weighted log-softmax,
    masked, averaged over positions) in plain torch, for its fused Triton kernel, which a
    CPU runs in Triton's interpreter at about 10 s a step on this machine."""

    @staticmethod
    def apply(logits: Any, target_p: Any, position_mask: Any) -> Any:
        import torch

        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(position_mask * target_p * logp).sum(-1).mean()


def _specforge_main(argv: list[str]) -> int:
    """``specforge train`` (its ``specforge.cli.main``, one process), the loss in plain torch."""
    from specforge import cli
    from specforge.algorithms.eagle3 import model

    model.LogSoftmaxLoss = TorchSoftmaxLoss  # type: ignore[assignment]
    return int(cli.main(["train", *argv]))


def eagle3_accuracy(ckpt: Path, draft_json: Path, model: Path, held: Path) -> tuple[int, int]:
    """The first draft position's top-1 accuracy of a SpecForge EAGLE-3 checkpoint on the
    held-out output ``held`` (real states)."""
    import torch
    from specforge.modeling.draft.registry import DRAFT_REGISTRY
    from specforge.training.model_loading import load_draft_config_source

    cfg = load_draft_config_source(str(draft_json))
    draft = DRAFT_REGISTRY[cfg.architectures[0]](cfg).float()
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["draft_state_dict"]
    res = draft.load_state_dict(state, strict=False)
    # SpecForge freezes the target's embedding in the draft and does not save it.
    assert not res.unexpected_keys and res.missing_keys == ["embed_tokens.weight"], res
    draft.load_embedding(str(model))
    draft.eval()
    correct = total = 0
    with torch.no_grad():
        for f in sorted(held.glob("rows_*/data_*.ckpt")):
            d = torch.load(f, weights_only=True)
            ids, mask = d["input_ids"][None], d["loss_mask"][None]
            t = ids.shape[1]
            if t < 3:
                continue
            hs = draft.project_hidden_states(d["aux_hidden_state"].float())
            nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
            emb = draft.embed_input_ids(nxt).to(hs.dtype)
            attn = draft.prepare_decoder_attention_mask(
                attention_mask=torch.ones_like(ids),
                hidden_states=hs,
                batch_size=1,
                seq_length=t,
                past_key_values_length=0,
            )
            out = draft.backbone(
                input_embeds=emb,
                hidden_states=hs,
                cache_hidden=[[], []],
                attention_mask=attn,
                position_ids=torch.arange(t)[None],
                past_key_values=None,
                use_cache=True,
            )
            p = draft.compute_logits(out).argmax(-1)
            pred = p + draft.d2t[p]
            c, n = accuracy(pred[0, : t - 2], ids[0, 2:], mask[0, : t - 2])
            correct, total = correct + c, total + n
    return correct, total


# -- speculators' DFlash --------------------------------------------------------------------


def speculators_train(model: Path, data: Path, save: Path, a: Any) -> Path:
    """speculators' trainer in a child process (its CPU shim set there); its checkpoint."""
    argv = [
        "--speculator-type",
        "dflash",
        "--verifier-name-or-path",
        str(model),
        "--data-path",
        str(data),
        "--save-path",
        str(save),
        "--log-dir",
        str(save.with_name(save.name + "-logs")),
        "--target-layer-ids",
        *map(str, DFLASH_LAYERS),
        "--num-layers",
        "1",
        "--block-size",
        str(BLOCK),
        "--draft-attn-impl",
        "sdpa",
        "--loss-implementation",
        "eager",
        "--hidden-states-dtype",
        "float32",
        "--total-seq-len",
        str(a.total_seq_len),
        "--num-workers",
        "0",
        # Its --max-steps stops an epoch, not the run (each later epoch still takes a
        # step): only as many epochs as the steps need.
        "--epochs",
        str(epochs_for(data, a.draft_steps, a.total_seq_len)),
        "--max-steps",
        str(a.draft_steps),
        "--lr",
        str(a.lr),
        "--mask-token-id",
        "2",
        "--draft-vocab-size",
        "1000",
        "--seed",
        str(a.seed),
        # It must hold some rows out for its own validation (a ratio below 1): 2 or 3 here.
        "--train-data-ratio",
        "0.99",
    ]
    logged(
        [sys.executable, __file__, "speculators-train", *argv],
        save.with_name(save.name + ".log"),
        ENV,
    )
    ckpts = sorted((p for p in save.iterdir() if (p / "config.json").is_file()), key=_epoch)
    return ckpts[-1]


def epochs_for(data: Path, steps: int, seq_len: int) -> int:
    """Epochs of a speculators export at ``data`` that hold ``steps`` packed batches of
    ``seq_len`` tokens (packing fills about 80 % of a batch)."""
    from datasets import load_from_disk

    tokens = sum(load_from_disk(str(data))["seq_len"])
    per_epoch = max(1, int(0.8 * tokens / seq_len))
    return -(-steps // per_epoch)


def _epoch(p: Path) -> int:
    return int(p.name) if p.name.isdigit() else -1


def _speculators_main(argv: list[str]) -> int:
    """speculators' own ``main``, the CPU made its accelerator (as tests/test_speculators_train.py)."""
    import torch
    from speculators.train import trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    if torch.accelerator.current_accelerator() is None:

        def current(check_available: bool = False) -> Any:
            return None if check_available else torch.device("cpu")

        torch.accelerator.current_accelerator = current  # type: ignore[assignment]
        torch.accelerator.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.accelerator.is_available = lambda: False  # type: ignore[assignment]
        trainer.get_local_rank = lambda: "cpu"  # type: ignore[attr-defined]
    main(TrainConfig.resolve(argv))
    return 0


def dflash_accuracy(ckpt: Path, held: Path) -> tuple[int, int]:
    """The first masked slot's top-1 accuracy of a speculators DFlash checkpoint on the
    held-out speculators export ``held`` (real states): every supervised position is an
    anchor."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    cfg = DFlashSpeculatorConfig.from_pretrained(str(ckpt))
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # as trained (no flex on a CPU)
    draft = DFlashDraftModel.from_pretrained(str(ckpt), config=cfg).float().eval()
    torch.manual_seed(0)  # the same anchors for every checkpoint
    rows = load_from_disk(str(held)).with_format("torch")
    correct = total = 0
    with torch.no_grad():
        for k, f in enumerate(sorted((held / "hidden_states").glob("hs_*.safetensors"), key=_row)):
            d = load_file(str(f))
            ids = torch.as_tensor(rows[_row(f)]["input_ids"])[None]
            mask = torch.as_tensor(rows[_row(f)]["loss_mask"])[None]
            assert torch.equal(ids[0], d["token_ids"]), (k, f)
            hs = d["hidden_states"].float()  # [T, k+1, H]
            valid = mask.clone()
            valid[:, -BLOCK:] = 0
            n = int(valid.sum())
            if n == 0:
                continue
            t = ids.shape[1]
            _, logits, _, aligned, idx = draft._backbone_forward(
                hs[:, :-1].reshape(1, t, -1),
                ids,
                mask,
                hs[None, :, -1],
                torch.zeros_like(ids),
                max_anchors=min(n, ANCHORS),
            )
            p = logits.argmax(-1)
            if draft.d2t is not None:
                p = p + draft.d2t[p]
            slot1 = torch.arange(1, idx.numel(), BLOCK)
            c, m = accuracy(p[0, slot1], ids[0, idx[slot1]], aligned[0, slot1])
            correct, total = correct + c, total + m
    return correct, total


# -- the run ------------------------------------------------------------------------------


def run(a: Any) -> dict:
    """The whole measurement in ``a.work``; with ``a.reuse``, the steps a previous run there
    finished are kept (the target, the outputs, the controls, the drafters)."""
    import torch

    torch.set_num_threads(1)
    torch._dynamo.config.disable = True  # as TORCHDYNAMO_DISABLE in the trainers (see ENV)
    work = Path(a.work)
    if work.exists() and not a.reuse:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = work / "model"
    target = target_step(work, model, a)
    cfg = json.loads((model / "config.json").read_text())
    for split in ("train", "held"):
        if (work / f"dflash-{split}-sp").is_dir():
            continue
        data = work / f"{split}.jsonl"
        extract(model, data, work / f"eagle3-{split}", "eagle3", EAGLE3_LAYERS)
        extract(model, data, work / f"dflash-{split}", "dflash", DFLASH_LAYERS)
        out, to = work / f"dflash-{split}", work / f"dflash-{split}-sp"
        eagle3d("export", "-o", str(out), "--to", str(to), "--format", "speculators")
    log("extracted")
    if not (work / "dflash-control-sp").is_dir():
        n_e = shuffle_specforge(work / "eagle3-train", work / "eagle3-control", a.seed)
        n_d = shuffle_speculators(work / "dflash-train-sp", work / "dflash-control-sp", a.seed)
        log(f"controls written ({n_e} and {n_d} samples)")
    draft_json = specforge_files(work, cfg)
    results: dict[str, Any] = {"target": target}
    results["target_at_draft_positions"] = target_accuracy(model, work / "eagle3-held")
    log(f"target at the drafters' positions: {results['target_at_draft_positions']}")
    for arm, data in (("real", "eagle3-train"), ("control", "eagle3-control")):
        done = sorted((work / f"sf-{arm}").glob("*-step*/training_state.pt"))
        if done:
            ckpt = done[-1]
        else:
            ckpt = specforge_train(work, model, draft_json, work / data, f"sf-{arm}", a)
        c, n = eagle3_accuracy(ckpt, draft_json, model, work / "eagle3-held")
        results[f"eagle3_{arm}"] = {"correct": c, "counted": n, "accuracy": c / n}
        log(f"SpecForge EAGLE-3 {arm}: {c}/{n} = {c / n:.3f}")
    for arm, data in (("real", "dflash-train-sp"), ("control", "dflash-control-sp")):
        save = work / f"sp-{arm}"
        done = sorted((p for p in save.glob("*") if (p / "config.json").is_file()), key=_epoch)
        ckpt = done[-1] if done else speculators_train(model, work / data, save, a)
        c, n = dflash_accuracy(ckpt, work / "dflash-held-sp")
        results[f"dflash_{arm}"] = {"correct": c, "counted": n, "accuracy": c / n}
        log(f"speculators DFlash {arm}: {c}/{n} = {c / n:.3f}")
    results["seconds"] = round(time.monotonic() - t0, 1)
    results["args"] = {k: v for k, v in vars(a).items() if k != "func"}
    results["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    return results


def target_step(work: Path, model: Path, a: Any) -> dict:
    """Build and train the target (or, reusing, read what the last run recorded)."""
    done = work / "target.json"
    if done.is_file():
        return dict(json.loads(done.read_text()))
    h = str(a.hidden)
    eagle3d(
        "tiny-model",
        "--layers",
        "10",
        "--hidden",
        h,
        "--intermediate",
        str(2 * a.hidden),
        "--seed",
        str(a.seed),
        str(model),
    )
    train, held = split_lines(DEMO.read_text(encoding="utf-8").splitlines(), a.held_every)
    (work / "train.jsonl").write_text("\n".join(train) + "\n")
    (work / "held.jsonl").write_text("\n".join(held) + "\n")
    log(f"target: training {a.target_steps} steps on {len(train)} conversations")
    target = train_target(model, train, held, a)
    log(f"target held-out: {target['before']} -> {target['after']}")
    done.write_text(json.dumps(target))
    return target


def table(r: dict) -> str:
    t = r["target"]
    rows = [
        f"target (10 layers) held-out next-token accuracy {t['before']['accuracy']:.3f}"
        f" -> {t['after']['accuracy']:.3f} (answers {t['after']['answer_accuracy']:.3f}),"
        f" perplexity {t['before']['perplexity']:.1f} -> {t['after']['perplexity']:.1f}",
        "",
        "| trainer (first draft position, held-out) | real states | shuffled states"
        " (control) | the target itself, same positions |",
        "|---|---|---|---|",
    ]
    for key, name in (
        ("eagle3", "SpecForge 0.2.0 EAGLE-3"),
        ("dflash", "speculators 0.9.0 DFlash"),
    ):
        real, ctl = r[f"{key}_real"], r[f"{key}_control"]
        top = r["target_at_draft_positions"][key]
        rows.append(f"| {name} | {_cell(real)} | {_cell(ctl)} | {_cell(top)} |")
    rows.append(f"\nwhole run {r['seconds']:.0f} s")
    return "\n".join(rows)


def _cell(c: dict) -> str:
    return f"{c['accuracy']:.3f} ({c['correct']:,}/{c['counted']:,})"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "speculators-train":
        return _speculators_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "specforge-train":
        return _specforge_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    for name in ("shuffle-specforge", "shuffle-speculators"):
        s = sub.add_parser(name)
        s.add_argument("src")
        s.add_argument("dst")
        s.add_argument("--seed", type=int, default=0)
    acc = sub.add_parser("accuracy")
    acc.add_argument("pred")
    acc.add_argument("actual")
    acc.add_argument("mask")
    p.add_argument("--work", default="/tmp/eagle3d-drafter-learns")
    p.add_argument("--json", default=None)
    p.add_argument("--reuse", action="store_true", help="keep what a run in --work finished")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-every", type=int, default=5)
    p.add_argument("--target-steps", type=int, default=400)
    p.add_argument("--draft-steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-length", type=int, default=2)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--total-seq-len", type=int, default=256)
    a = p.parse_args()
    if a.cmd == "shuffle-specforge":
        print(shuffle_specforge(Path(a.src), Path(a.dst), a.seed))
    elif a.cmd == "shuffle-speculators":
        print(shuffle_speculators(Path(a.src), Path(a.dst), a.seed))
    elif a.cmd == "accuracy":
        import torch

        pred, actual, mask = (
            torch.tensor([int(x) for x in s.split(",")]) for s in (a.pred, a.actual, a.mask)
        )
        correct, counted = accuracy(pred, actual, mask)
        print(json.dumps({"correct": correct, "counted": counted}))
    else:
        r = run(a)
        print(table(r))
        if a.json:
            Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
