"""The producer a job's configuration asks for, and what starting it is called."""

from __future__ import annotations

from eagle3d import config
from eagle3d.produce.base import Producer


def make_producer(
    cfg: config.JobConfig, *, dump_dir: str, hidden_size: int, layers: list[int], store_dtype: str
) -> Producer:
    """The producer of ``cfg.backend`` (its heavy imports happen here, not before)."""
    if cfg.backend == "synthetic":
        from eagle3d.produce.synthetic import SyntheticProducer

        return SyntheticProducer(
            dump_dir=dump_dir,
            hidden_size=hidden_size,
            aux_layers=layers,
            dtype=store_dtype,
            threads=(cfg.workers or 1) + 1,
            window=cfg.concurrency or 8,
        )
    if cfg.backend == "sglang":
        from eagle3d.produce.sglang import SGLangProducer

        return SGLangProducer(
            cfg.server,
            dump_dir=dump_dir,
            aux_layers=layers,
            concurrency=cfg.concurrency or 32,
            request_timeout=cfg.request_timeout,
        )
    from eagle3d.produce.hf import HFProducer

    return HFProducer(
        cfg.model,
        dump_dir=dump_dir,
        aux_layers=layers,
        workers=cfg.workers,
        threads=cfg.worker_threads,
        batch_tokens=cfg.batch_tokens,
        device=cfg.device,
        dtype=cfg.dtype,
        store_dtype=store_dtype,
        hang_timeout=cfg.request_timeout,
        window=cfg.concurrency,
    )


def starting_words(cfg: config.JobConfig) -> tuple[str, str]:
    """The run state while the producer starts, and what it is doing, in words."""
    if cfg.backend == "hf":
        return "loading", f"loading model {cfg.model} (hf, device {cfg.device})"
    if cfg.backend == "sglang":
        return "starting", f"connecting to the SGLang server at {cfg.server}"
    return "starting", f"starting the {cfg.backend} producer"
