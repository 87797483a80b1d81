"""A chat template compiled in the environment Hugging Face's ``apply_chat_template`` renders
it in, without importing transformers (whose import alone is a second of CPU at every start).

The environment is transformers' own (``transformers.utils.chat_template_utils.
_cached_compile_jinja_template``, transformers 5, Apache-2.0): jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag (parsed; its markers are not needed here, the loss mask comes from
:mod:`eagle3d.ingest.chat`'s renderings), a ``tojson`` that does not escape HTML,
``raise_exception``, ``strftime_now``, and ``dict`` and ``namespace`` that refuse dunder and
underscore names. tests/test_template.py renders every template of tests/test_chat.py here
and through transformers, and compares.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, no_type_check

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` for templates: a call and ``fromkeys``, no attribute of the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace`` for templates: no underscore-prefixed attribute may be stored."""

    @no_type_check
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> Callable[..., str]:
    """The template's render function (raises jinja's ``TemplateSyntaxError``)."""
    render: Callable[..., str] = _environment().from_string(template).render
    return render


__all__ = ["compile_template"]
