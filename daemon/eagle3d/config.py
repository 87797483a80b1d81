"""Job configuration: the same settings from ``--config JOB.toml`` and from flags.

Flags override the file. An unknown key, or a value of the wrong type, is an error that
names the file and the key (exit code 2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tomllib
from typing import Any

import msgspec
from eagle3proto.paths import Shard

from eagle3d.remote import storedtype


class ConfigError(ValueError):
    """A configuration problem; the message names the file and key."""


class JobConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting of an extraction job."""

    model: str = ""
    dataset: str = ""
    output: str = ""
    backend: str = "hf"
    server: str = ""
    max_length: int = 2048
    on_overflow: str = "truncate"
    max_line_bytes: int = 64 << 20  # a longer JSONL line fails alone, never read whole
    aux_layers: list[int] = []  # the old name of ``layers`` (--aux-layers), kept as an alias
    recipe: str = ""  # eagle3d.remote.recipes: eagle3 (default), eagle3.1, p-eagle, dflash, ...
    layers: list[int] = []  # target layer ids in eagle3d's convention; [] = recipe's default
    draft_config: str = ""  # a draft model's config.json: recipe and layers from it
    shard: str = ""
    dump_dir: str = ""
    socket: str = ""
    group: str = ""  # "": the job's files are the owner's alone; else this group may read them
    concurrency: int = 0
    max_attempts: int = 3
    request_timeout: float = 600.0
    batch_tokens: int = 0  # 0: by the device, see eagle3d.produce.hf_layout.token_budget()
    workers: int = 0  # 0: automatic, see eagle3d.produce.hf_layout.worker_layout()
    worker_threads: int = 0  # 0: the CPUs divided among the workers
    device: str = "auto"
    dtype: str = "auto"
    store_dtype: str = "auto"  # see eagle3d.remote.storedtype: auto = the model's own 16-bit dtype
    commit_threads: int = 0  # 0: automatic, see commit_thread_count()
    writer: str = "archive"  # archive (own writer, direct I/O) | torch (torch.save, the reference)
    force_resume: bool = False
    max_failed_fraction: float = 0.05  # more failures for good than this: exit 9
    space_reserve: str = "256M"  # left free beside the job (eagle3d.store.sizing.parse_size)
    no_space_check: bool = False  # start even if the job does not fit (no exit 10)

    def validate(self) -> None:
        """Check values that types alone cannot. Raises ConfigError."""
        for key in ("model", "dataset", "output"):
            if not getattr(self, key):
                raise ConfigError(f"{key} is required (--{key.replace('_', '-')} or `{key} =`)")
        _choice("backend", self.backend, ("hf", "sglang", "synthetic"))
        _choice("on_overflow", self.on_overflow, ("truncate", "skip"))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _choice("store_dtype", self.store_dtype, storedtype.CHOICES)
        _choice("writer", self.writer, ("archive", "torch"))
        if self.backend == "sglang" and not self.server:
            raise ConfigError("backend 'sglang' needs server (--server URL)")
        if self.backend == "sglang" and not self.dump_dir:
            raise ConfigError(
                "backend 'sglang' needs dump_dir (--dump-dir): the directory the server's "
                "capture hook writes to (`eagle3d sglang-args` prints the server side)"
            )
        if self.backend == "sglang":
            from eagle3d.produce.sglang_info import server_url_problem

            problem = server_url_problem(self.server)
            if problem:
                raise ConfigError(f"server: {problem}")
        self._check_layers()
        self.group_id()
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for key in ("workers", "worker_threads", "commit_threads", "batch_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0 (0: automatic), got {getattr(self, key)}")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ConfigError(
                f"max_failed_fraction must be between 0 and 1, got {self.max_failed_fraction}"
            )
        if self.max_length < 0:
            raise ConfigError(f"max_length must be >= 0, got {self.max_length}")
        if self.max_line_bytes < 1:
            raise ConfigError(f"max_line_bytes must be >= 1, got {self.max_line_bytes}")
        from eagle3d.store.sizing import parse_size

        try:
            parse_size(self.space_reserve, 1)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.shard_spec()

    def group_id(self) -> int:
        """The gid of ``group`` (-1 when none: the files are the owner's alone). Raises
        ConfigError for a group this machine does not know."""
        if not self.group:
            return -1
        import grp

        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise ConfigError(f"group: unknown group {self.group!r} (see getent group)") from None

    def _check_layers(self) -> None:
        from eagle3d.remote import recipes

        if self.aux_layers and self.layers and self.aux_layers != self.layers:
            raise ConfigError(
                f"layers {self.layers} and aux_layers {self.aux_layers} differ "
                "(aux_layers is the old name of layers: give one)"
            )
        if self.recipe:
            _choice("recipe", self.recipe, recipes.NAMES)
        ids = self.target_layers()
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ConfigError(f"layers: {ids} repeat {dup}; every layer id must be distinct")
        r = recipes.get(self.recipe or recipes.DEFAULT)
        if ids and r.layer_count and len(ids) != r.layer_count:
            raise ConfigError(f"layers: {r.name} takes {r.layer_count} layer ids, got {ids}")

    def target_layers(self) -> list[int]:
        """The layers asked for (``--layers`` or its alias ``--aux-layers``); [] = default."""
        return list(self.layers or self.aux_layers)

    def commit_thread_count(self, cpus: int | None = None) -> int:
        """``commit_threads``, or when 0 one per CPU between 2 and 8.

        Each commit spends most of its time waiting on fdatasync, so commits overlap well:
        on a 16-core GPU node, 8 threads doubled end-to-end tokens/s against 2 (h2048 bf16,
        docs/benchmarks.md), while a 2-core machine keeps 2.
        """
        if self.commit_threads:
            return self.commit_threads
        return max(2, min(8, cpus if cpus is not None else (os.cpu_count() or 2)))

    def shard_spec(self, env: dict[str, str] | None = None) -> Shard:
        """``--shard I/N``, else the scheduler's variables (:data:`SHARD_VARIABLES`: a Slurm
        array, torchrun, a Kubernetes Indexed Job), else 0/1."""
        if self.shard:
            try:
                return Shard.parse(self.shard)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        env = dict(os.environ) if env is None else env
        for idx_key, cnt_key in SHARD_VARIABLES:
            if env.get(idx_key) and env.get(cnt_key):
                try:
                    return Shard(int(env[idx_key]), int(env[cnt_key]))
                except ValueError as e:
                    raise ConfigError(f"{idx_key}/{cnt_key}: {e}") from e
        if env.get("JOB_COMPLETION_INDEX"):
            # Kubernetes gives a pod of an Indexed Job its index, never the Job's
            # completions: a pod that guessed N = 1 would take the whole dataset.
            raise ConfigError(
                "JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job) but not"
                f" {SHARD_COUNT_VARIABLE}: set it to the Job's spec.completions in the pod's"
                " env (docs/kubernetes.md), or pass --shard I/N"
            )
        return Shard(0, 1)


#: The shard count of a Kubernetes Indexed Job: the manifest sets it to spec.completions.
SHARD_COUNT_VARIABLE = "EAGLE3D_SHARD_COUNT"
#: (index, count) variables read when --shard is not given, first match wins: a Slurm
#: array, torchrun (and other launchers of its convention), a Kubernetes Indexed Job.
SHARD_VARIABLES = (
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
    ("RANK", "WORLD_SIZE"),
    ("JOB_COMPLETION_INDEX", SHARD_COUNT_VARIABLE),
)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


FIELDS = tuple(JobConfig.__struct_fields__)


def load_toml(path: str) -> dict[str, Any]:
    """Read a job file; errors name the file (and line, for syntax errors)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such config file") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from e
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (known: {', '.join(FIELDS)})")
    return data


def build(file_values: dict[str, Any], flag_values: dict[str, Any], source: str = "") -> JobConfig:
    """Merge file values with flags (flags win) into a validated JobConfig."""
    merged = dict(file_values)
    merged.update({k: v for k, v in flag_values.items() if v is not None})
    try:
        cfg = msgspec.convert(merged, JobConfig)
    except msgspec.ValidationError as e:
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}{e}") from e
    cfg.validate()
    return cfg


#: The settings that only a run uses: how it reaches and drives the producer, where it puts
#: its transient files, and whether it may start. ``eagle3d plan`` neither takes nor lists
#: them (a job file may still hold them: plan reads the file as the run does and ignores them).
RUN_ONLY = frozenset(
    {
        "server",
        "dump_dir",
        "socket",
        "group",
        "concurrency",
        "max_attempts",
        "request_timeout",
        "batch_tokens",
        "workers",
        "worker_threads",
        "device",
        "dtype",
        "writer",
        "no_space_check",
        "force_resume",
    }
)


def add_job_arguments(p: argparse.ArgumentParser, *, run: bool = True) -> None:
    """The flags of ``eagle3d run`` (every one also a TOML key); with ``run=False`` those
    that shape the plan only (not :data:`RUN_ONLY`), for ``eagle3d plan``.

    Long: one ``add_argument`` per flag, in the order ``--help`` lists them; a table, not
    logic."""

    def a(*flags: str, **kw: Any) -> None:
        dest = kw.get("dest") or flags[0].lstrip("-").replace("-", "_")
        if run or dest not in RUN_ONLY:
            p.add_argument(*flags, **kw)

    a("--config", metavar="JOB.toml", help="read settings from a TOML job file")
    a("--model", help="model directory (weights + tokenizer + chat template)")
    a(
        "--dataset",
        help="dataset file: JSONL (.jsonl, .jsonl.gz, .jsonl.zst), a JSON array, or parquet",
    )
    a("--output", "-o", help="output directory")
    a(
        "--backend",
        choices=("hf", "sglang", "synthetic"),
        help="producer: hf (default), sglang, or synthetic (dumps at memory speed, for sizing disks)",
    )
    a("--server", help="SGLang server URL (backend sglang)")
    a(
        "--max-length",
        type=int,
        dest="max_length",
        help="token limit per sample (default 2048; 0: no limit)",
    )
    a(
        "--on-overflow",
        choices=("truncate", "skip"),
        dest="on_overflow",
        help="a sample longer than --max-length: truncate keeps its first max-length tokens"
        " (counted as truncated in the journal, the monitor and `eagle3d report`); skip fails"
        " it as too_long (default truncate)",
    )
    a(
        "--max-line-bytes",
        type=int,
        dest="max_line_bytes",
        metavar="N",
        help="a JSONL line longer than this fails alone, named, without being read whole;"
        " a JSON array's item or a parquet row over it fails alone, never decoded"
        " (default 67108864: 64 MiB)",
    )
    a(
        "--recipe",
        choices=("eagle3", "eagle3.1", "p-eagle", "dflash", "domino", "dspark"),
        help="the drafter the data is for: its layers and record (default eagle3; see"
        " docs/training.md)",
    )
    a(
        "--layers",
        type=_layers,
        metavar="L1,L2,...",
        help="target layer ids, distinct: the states entering those layers (Hugging Face"
        " output_hidden_states[i]); default: the recipe's",
    )
    a(
        "--aux-layers",
        type=_layers,
        dest="aux_layers",
        metavar="A,B,C",
        help="the old name of --layers (default: the recipe's)",
    )
    a(
        "--draft-config",
        dest="draft_config",
        metavar="PATH",
        help="a draft model's config.json (SpecForge, z-lab or speculators): the recipe and"
        " layers from it, converted from that project's index convention",
    )
    a(
        "--shard",
        metavar="I/N",
        help="take samples with idx %% N == I (default: SLURM_ARRAY_TASK_ID/"
        "SLURM_ARRAY_TASK_COUNT, RANK/WORLD_SIZE, JOB_COMPLETION_INDEX/EAGLE3D_SHARD_COUNT,"
        " else 0/1); N may change between runs (docs/slurm.md)",
    )
    a("--dump-dir", dest="dump_dir", help="where producers drop dumps (default /dev/shm/...)")
    a(
        "--socket",
        help="Unix socket for live subscribers (default: $RUNTIME_DIRECTORY, else"
        " $XDG_RUNTIME_DIR/eagle3d/, else beside the journal)",
    )
    a(
        "--group",
        metavar="NAME",
        help="a group that may read the job's files: every folder and file the daemon makes"
        " under the output, and the socket, belong to it (folders 0750 and setgid, files 0640);"
        " default none: the files are the owner's alone",
    )
    a(
        "--concurrency",
        type=int,
        help="requests waiting at the producer (default, or 0: the producer's); the HF worker's"
        " running batch is not counted, so its batcher always chooses from this many",
    )
    a("--max-attempts", type=int, dest="max_attempts", help="attempts per sample (default 3)")
    a(
        "--request-timeout",
        type=float,
        dest="request_timeout",
        metavar="S",
        help="seconds an attempt may take at the producer before it counts as failed and is"
        " retried (default 600)",
    )
    a(
        "--batch-tokens",
        type=int,
        dest="batch_tokens",
        help="HF token budget per batch (default, or 0: automatic: 8192 on a GPU, 512 on a CPU)",
    )
    a(
        "--workers",
        type=int,
        help="HF worker processes (default, or 0: automatic: one per GPU; on a CPU one per core, at most 8,"
        " and only as many model copies as half the available memory holds)",
    )
    a(
        "--worker-threads",
        type=int,
        dest="worker_threads",
        help="torch threads in each HF worker (default, or 0: automatic: the CPUs divided among"
        " the workers)",
    )
    a(
        "--device",
        choices=("auto", "cpu", "cuda"),
        help="where the HF workers run (default auto: cuda when a GPU is visible, else cpu)",
    )
    a(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="compute dtype (default: float32 on a CPU, bfloat16 on a GPU)",
    )
    a(
        "--store-dtype",
        choices=storedtype.CHOICES,
        dest="store_dtype",
        help="dtype of the states in the files, whatever the compute dtype (default auto: the"
        " model's own 16-bit dtype from its config, else bfloat16; float32 only when asked)",
    )
    a(
        "--writer",
        choices=("archive", "torch"),
        dest="writer",
        help="how sample files are written: archive (eagle3d's own writer of torch.save's"
        " format, with direct I/O; default) or torch (torch.save itself, the reference);"
        " the files are read the same way",
    )
    a(
        "--commit-threads",
        type=int,
        dest="commit_threads",
        help="threads writing samples to the output (default, or 0: automatic: one per CPU, 2 to 8)",
    )
    a(
        "--max-failed-fraction",
        type=float,
        dest="max_failed_fraction",
        metavar="F",
        help="a finished run in which more than this share of the samples failed for good"
        " (or every one did) exits 9 (default 0.05)",
    )
    a(
        "--space-reserve",
        dest="space_reserve",
        metavar="SIZE",
        help="left free on the output filesystem beside the job: 256M (default), 1G, 2%%;"
        " a run that does not fit with it is refused (exit 10)",
    )
    a(
        "--no-space-check",
        action="store_const",
        const=True,
        dest="no_space_check",
        help="start even if the job does not fit on the output filesystem (see eagle3d plan)",
    )
    a(
        "--force-resume",
        action="store_const",
        const=True,
        dest="force_resume",
        help="resume even if the dataset or config changed",
    )


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from e


def from_args(args: argparse.Namespace) -> JobConfig:
    """Build the job config from parsed flags and the optional ``--config`` file."""
    file_values = load_toml(args.config) if getattr(args, "config", None) else {}
    flags = {k: getattr(args, k, None) for k in FIELDS}
    return build(file_values, flags, args.config or "")


# -- model facts and the job fingerprint ----------------------------------------------------


def model_config(model_dir: str) -> dict[str, Any]:
    """The model's config.json (the text config for multimodal wrappers)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg: dict[str, Any] = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{model_dir}: no config.json (is this a model directory?)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise OSError(f"{path}: unreadable ({e})") from e
    text: dict[str, Any] = cfg.get("text_config", cfg)
    return text


def file_sha(path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint(parts: dict[str, Any]) -> str:
    """A stable hash of what makes two runs the same job."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
