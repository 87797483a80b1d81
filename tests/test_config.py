"""Job configuration: TOML + flags, errors that name the key, shard resolution."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from eagle3d import config
from eagle3d.config import ConfigError, JobConfig
from eagle3d.remote.dumpfile import default_aux_layers
from eagle3proto.paths import Shard


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_job_arguments(p)
    return p.parse_args(argv)


def write(tmp_path: Path, text: str) -> str:
    f = tmp_path / "job.toml"
    f.write_text(text)
    return str(f)


def test_flags_override_the_file(tmp_path: Path) -> None:
    job = write(tmp_path, 'model = "/m"\ndataset = "/d.jsonl"\noutput = "/o"\nmax_length = 512\n')
    cfg = config.from_args(parse("--config", job, "--max-length", "64", "--aux-layers", "1,2,3"))
    assert (cfg.model, cfg.max_length, cfg.aux_layers) == ("/m", 64, [1, 2, 3])
    assert cfg.backend == "hf" and cfg.max_attempts == 3  # defaults fill the rest


def test_every_flag_is_a_toml_key() -> None:
    dests = {a.dest for a in argparse.ArgumentParser()._actions}
    p = argparse.ArgumentParser()
    config.add_job_arguments(p)
    flags = {a.dest for a in p._actions} - dests - {"config"}
    assert flags == set(config.FIELDS)


def test_unknown_key_is_named(tmp_path: Path) -> None:
    job = write(tmp_path, 'model = "/m"\ndataset = "/d"\noutput = "/o"\nbatch_tokenz = 5\n')
    with pytest.raises(ConfigError, match=r"job\.toml: unknown key 'batch_tokenz'"):
        config.from_args(parse("--config", job))


def test_wrong_type_is_named(tmp_path: Path) -> None:
    job = write(tmp_path, 'model = "/m"\ndataset = "/d"\noutput = "/o"\nmax_length = "long"\n')
    with pytest.raises(ConfigError, match=r"job\.toml: .*max_length"):
        config.from_args(parse("--config", job))


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    job = write(tmp_path, 'model = "/m"\ndataset = \n')
    with pytest.raises(ConfigError, match=r"job\.toml: .*line 2"):
        config.from_args(parse("--config", job))


def test_missing_required_and_bad_values() -> None:
    with pytest.raises(ConfigError, match="model is required"):
        config.build({}, {"dataset": "/d", "output": "/o"})
    with pytest.raises(ConfigError, match="server"):
        config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", "backend": "sglang"})
    with pytest.raises(ConfigError, match="dump_dir"):
        config.build(
            {}, {"model": "/m", "dataset": "/d", "output": "/o", "backend": "sglang", "server": "u"}
        )
    with pytest.raises(ConfigError, match="3 layer ids"):
        config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", "aux_layers": [1, 2]})
    with pytest.raises(ConfigError, match="repeat"):
        config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", "layers": [2, 3, 3]})
    with pytest.raises(ConfigError, match="recipe"):
        config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", "recipe": "medusa"})
    with pytest.raises(ConfigError, match="shard"):
        config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", "shard": "3/2"})


def test_commit_threads_default_follows_the_cpus_within_2_to_8() -> None:
    cfg = JobConfig(model="m", dataset="d", output="o")
    assert [cfg.commit_thread_count(cpus=n) for n in (1, 2, 4, 16, 128)] == [2, 2, 4, 8, 8]
    assert 2 <= cfg.commit_thread_count() <= 8  # this machine's count
    pinned = config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", "commit_threads": 3})
    assert pinned.commit_thread_count(cpus=16) == 3
    with pytest.raises(ConfigError, match="commit_threads must be >= 0"):
        config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", "commit_threads": -1})


def test_worker_settings_default_to_automatic_and_refuse_negatives() -> None:
    cfg = config.build({}, {"model": "/m", "dataset": "/d", "output": "/o"})
    # eagle3d.produce.hf_layout: worker_layout() and token_budget()
    assert (cfg.workers, cfg.worker_threads, cfg.batch_tokens) == (0, 0, 0)
    args = parse("--model", "/m", "--dataset", "/d", "--output", "/o", "--worker-threads", "3")
    assert config.from_args(args).worker_threads == 3
    for key in ("workers", "worker_threads", "batch_tokens"):
        with pytest.raises(ConfigError, match=f"{key} must be >= 0"):
            config.build({}, {"model": "/m", "dataset": "/d", "output": "/o", key: -1})


def test_shard_from_flag_then_slurm_then_torchrun() -> None:
    cfg = JobConfig(model="m", dataset="d", output="o")
    assert cfg.shard_spec({}) == Shard(0, 1)
    assert cfg.shard_spec({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"}) == Shard(
        3, 8
    )
    assert cfg.shard_spec({"RANK": "1", "WORLD_SIZE": "4"}) == Shard(1, 4)
    both = {
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_ARRAY_TASK_COUNT": "4",
        "RANK": "0",
        "WORLD_SIZE": "2",
    }
    assert cfg.shard_spec(both) == Shard(2, 4)
    cfg.shard = "1/2"
    assert cfg.shard_spec(both) == Shard(1, 2)


def test_default_aux_layers_follow_sglang() -> None:
    assert default_aux_layers(61) == [2, 30, 58]  # DeepSeek-V3 / Kimi-K2.5
    assert default_aux_layers(32) == [2, 16, 29]
    # Distinct for every model of 4 layers or more (SGLang's rule repeats below 7: the demo's
    # 6-layer model got 2,3,3, which SpecForge refuses).
    for n in range(4, 80):
        assert len(set(default_aux_layers(n))) == 3, n
        assert all(1 <= i < n for i in default_aux_layers(n)), n
    assert default_aux_layers(6) == [1, 3, 5]


def test_layers_recipe_and_draft_config_flags() -> None:
    base = ("--model", "/m", "--dataset", "/d", "--output", "/o")
    cfg = config.from_args(parse(*base, "--recipe", "dflash", "--layers", "1,3,5,7,9"))
    assert (cfg.recipe, cfg.target_layers()) == ("dflash", [1, 3, 5, 7, 9])
    cfg = config.from_args(parse(*base, "--aux-layers", "2,3,4"))
    assert cfg.target_layers() == [2, 3, 4]  # the old name is an alias
    cfg = config.from_args(parse(*base, "--draft-config", "/x/config.json"))
    assert cfg.draft_config == "/x/config.json"
    with pytest.raises(ConfigError, match="differ"):
        config.build(
            {"aux_layers": [1, 2, 3]},
            {"model": "/m", "dataset": "/d", "output": "/o", "layers": [1, 2, 4]},
        )


def test_the_writer_is_archive_or_the_torch_reference() -> None:
    base = {"model": "/m", "dataset": "/d", "output": "/o"}
    assert config.build({}, base).writer == "archive"
    assert config.build({}, {**base, "writer": "torch"}).writer == "torch"
    args = parse("--model", "/m", "--dataset", "/d", "--output", "/o", "--writer", "torch")
    assert config.from_args(args).writer == "torch"
    with pytest.raises(ConfigError, match="writer"):
        config.build({}, {**base, "writer": "fast"})


def test_group_names_a_known_group_or_is_refused() -> None:
    import grp
    import os

    base = {"model": "m", "dataset": "d", "output": "o"}
    assert config.build(base, {}).group_id() == -1  # none: the files are the owner's alone
    mine = grp.getgrgid(os.getgid()).gr_name
    assert config.build({**base, "group": mine}, {}).group_id() == os.getgid()
    with pytest.raises(ConfigError, match="unknown group 'e3d-no-such-group'"):
        config.build(base, {"group": "e3d-no-such-group"})
