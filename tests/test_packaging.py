"""Packaging: properly named packages, a torch-free base install, light imports."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "textual", "sglang")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_base_install_has_no_torch_transformers_or_sglang() -> None:
    deps = " ".join(pyproject()["project"]["dependencies"]).lower()
    for heavy in ("torch", "transformers", "sglang", "safetensors"):
        assert heavy not in deps
    extras = pyproject()["project"]["optional-dependencies"]
    assert any(d.startswith("torch") for d in extras["extract"])
    assert extras["sglang"] == ["sglang==0.5.21"]
    assert any("nvidia-ml-py" in d for d in extras["gpu"])


def test_console_scripts() -> None:
    scripts = pyproject()["project"]["scripts"]
    assert scripts == {"eagle3d": "eagle3d.cli:main", "eagle3-top": "eagle3top.cli:main"}


def test_no_bare_top_level_modules_installed(tmp_path: Path) -> None:
    # Run from elsewhere: the repository root itself would shadow what is installed.
    code = (
        "import importlib.util as u, json; "
        "print(json.dumps({m: u.find_spec(m) is not None for m in "
        "('daemon', 'tui', 'shared', 'eagle3d', 'eagle3top', 'eagle3proto')}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout
    found = json.loads(out)
    assert found == {
        "daemon": False,
        "tui": False,
        "shared": False,
        "eagle3d": True,
        "eagle3top": True,
        "eagle3proto": True,
    }


def loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split()
    return {m.split(".")[0] for m in out}


def test_shared_contract_imports_nothing_heavy() -> None:
    mods = loaded_after(
        "import eagle3proto.events, eagle3proto.codec, eagle3proto.journal, "
        "eagle3proto.reducer, eagle3proto.paths, eagle3proto.wire"
    )
    assert not mods & set(HEAVY), mods & set(HEAVY)


def test_daemon_cli_help_stays_light() -> None:
    mods = loaded_after("import eagle3d.cli; eagle3d.cli.build_parser()")
    assert not mods & {"torch", "transformers", "sglang", "textual"}, mods & set(HEAVY)
