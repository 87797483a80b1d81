"""The tokenizer kept beside the journal (:mod:`eagle3d.ingest.tokcache`) and the chat
template's environment without transformers (:mod:`eagle3d.ingest.template`): each gives
exactly what Hugging Face's own objects give, and a kept tokenizer is used only for the
model files it was made from."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
import runkit
from eagle3d.ingest import chat, tokcache
from eagle3d.ingest.chat import ChatEncoder, facts_of
from eagle3d.ingest.dataset import BadSample
from eagle3d.ingest.template import compile_template
from test_chat import TEMPLATES, demo_conversations, marked, unmarked


def _hf(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, local_files_only=True)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder of the tiny tokenizer saved with a model family's template and special
    tokens, as transformers writes one."""
    template, specials, _ = TEMPLATES[request.param]
    tok = _hf(tiny_model_dir)
    if specials:
        tok.add_tokens(specials, special_tokens=True)
    tok.chat_template = unmarked(template)
    d = tmp_path_factory.mktemp(f"model-{request.param}")
    tok.save_pretrained(d)
    return d


def _outcome(enc: ChatEncoder, c: Any) -> Any:
    try:
        t = enc.encode(c)
    except BadSample as e:
        return (e.error, e.reason)
    return (t.input_ids, t.loss_mask, t.truncated, t.full_length)


def test_a_kept_tokenizer_encodes_as_hugging_faces(family: Path, tmp_path: Path) -> None:
    hf = facts_of(_hf(family))
    assert tokcache.save(str(tmp_path), str(family), hf)
    kept = tokcache.load([str(tmp_path)], str(family))
    assert kept is not None
    assert type(kept.backend).__module__.startswith("tokenizers")
    assert (kept.chat_template, kept.vocab_size) == (hf.chat_template, hf.vocab_size)
    assert (kept.template_vars, kept.specials) == (hf.template_vars, hf.specials)
    for max_length in (0, 40):
        a, b = ChatEncoder(hf, max_length), ChatEncoder(kept, max_length)
        convs = demo_conversations()
        assert [_outcome(a, c) for c in convs] == [_outcome(b, c) for c in convs]
        assert len(convs) > 150


def _copy(model: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(model, d)
    return d


@pytest.mark.parametrize(
    "change",
    ["template", "added file", "removed file", "damaged", "foreign"],
)
def test_a_kept_tokenizer_of_other_files_is_not_used(
    tiny_model_dir: Path, tmp_path: Path, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = _copy(tiny_model_dir, tmp_path)
    jdir = tmp_path / "j"
    jdir.mkdir()
    assert tokcache.save(str(jdir), str(model), facts_of(_hf(model)))
    kept = Path(tokcache.path_in(str(jdir)))
    if change == "template":
        (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
        why = "the model's tokenizer files or libraries changed"
    elif change == "added file":
        (model / "special_tokens_map.json").write_text("{}")
        why = "the model's tokenizer files or libraries changed"
    elif change == "removed file":
        (model / "tokenizer_config.json").unlink()
        why = "the model's tokenizer files or libraries changed"
    elif change == "damaged":
        b = bytearray(kept.read_bytes())
        b[len(b) // 2] ^= 1
        kept.write_bytes(bytes(b))
        why = "its checksum does not match (damaged)"
    else:
        kept.write_bytes(b"E3DCKPT\x01" + bytes(100))
        why = "it is not a file of this kind and version"
    with caplog.at_level(logging.INFO, logger="eagle3d"):
        assert tokcache.load([str(jdir)], str(model)) is None
    assert f"{kept} was not used: {why}" in caplog.text


def test_the_encoder_is_made_once_and_kept_once_accepted(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = str(_copy(tiny_model_dir, tmp_path))
    jdir = tmp_path / "j"
    jdir.mkdir()
    first = chat.encoder(model, 7, kept=[str(jdir)])  # a space check: reads, keeps nothing
    assert not (jdir / tokcache.NAME).exists()
    assert chat.encoder(model, 7, kept=[str(jdir)], keep=str(jdir)) is first  # the feeder
    assert (jdir / tokcache.NAME).is_file()
    chat._made.clear()  # a new process
    again = chat.encoder(model, 7, kept=[str(jdir)], keep=str(jdir))
    assert again is not first and again.tokenizer is again.facts  # from the kept file
    c = demo_conversations()[0]
    assert _outcome(again, c) == _outcome(first, c)


# -- the template's environment ------------------------------------------------------------


def _transformers_render(template: str) -> Any:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).render


EXTRA = {
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% if loop.first %}{% continue %}{% endif %}{{ m['content'] }}{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% set ns.n = ns.n + m['content'] | length %}{% endfor %}{{ ns.n }}",
    "dict": "{{ dict(a=1, b=messages | length) }}{{ dict.fromkeys(['x', 'y'], 0) }}",
}


@pytest.mark.parametrize(
    "template",
    [f(t) for t, _, _ in TEMPLATES.values() for f in (marked, unmarked)] + list(EXTRA.values()),
)
def test_the_template_renders_as_in_transformers(template: str) -> None:
    ours, theirs = compile_template(template), _transformers_render(template)
    n = 0
    for c in demo_conversations()[:80]:
        for gen in (False, True):
            kw = {"messages": c.messages(), "add_generation_prompt": gen, "bos_token": "<s>"}
            try:
                want: Any = theirs(**kw)
            except jinja2.exceptions.TemplateError as e:
                want = type(e)
            try:
                got: Any = ours(**kw)
            except jinja2.exceptions.TemplateError as e:
                got = type(e)
            assert got == want, (template, c.idx, gen)
            n += isinstance(want, str)
    assert n > 0


@pytest.mark.parametrize(
    "template",
    [
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace() %}{% set ns._y = 2 %}",
        "{{ raise_exception('no') }}",
        "{{ messages.__class__.__mro__ }}",
    ],
)
def test_the_sandbox_refuses_what_transformers_refuses(template: str) -> None:
    kw = {"messages": [{"role": "user", "content": "q"}]}
    with pytest.raises(jinja2.exceptions.TemplateError) as theirs:
        _transformers_render(template)(**kw)
    with pytest.raises(jinja2.exceptions.TemplateError) as ours:
        compile_template(template)(**kw)
    assert type(ours.value) is type(theirs.value)


# -- through the daemon ----------------------------------------------------------------------


def test_a_resume_loads_the_kept_tokenizer_until_the_model_changes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = _copy(tiny_model_dir, tmp_path)
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    runkit.dataset(data, 12, malformed=False)
    r = runkit.run(model, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = out / ".eagle3d" / "journal" / "shard-0-of-1" / tokcache.NAME
    assert kept.is_file(), r.stderr[-3000:]
    assert "tokenizer: as kept" not in r.stderr
    runkit.dataset(data, 20, malformed=False)  # more rows: a changed job, resumed as forced
    r = runkit.run(model, data, out, "--force-resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"tokenizer: as kept in {kept} (the model's tokenizer files unchanged)" in r.stderr
    runkit.assert_complete(out, set(range(20)), set())
    (model / "tokenizer_config.json").write_text(
        (model / "tokenizer_config.json")
        .read_text()
        .replace('"model_max_length": 4096', '"model_max_length": 4097')
    )
    runkit.dataset(data, 24, malformed=False)
    r = runkit.run(model, data, out, "--force-resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{kept} was not used: the model's tokenizer files or libraries changed" in r.stderr
    runkit.assert_complete(out, set(range(24)), set())
