"""Rendering a template: the Jinja2 sandbox it runs in, its compiled form, and :func:`render_prompt`.

Templates are operator-owned code, but they still run in Jinja's immutable sandbox with
strict undefined variables: a typo or an unsafe attribute is a :class:`TemplateError`
naming the file and line, never a prompt with a silent hole in it. The data they show
arrives as variables (:class:`robot_llm.prompting.context.RenderContext`), never as source.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import FunctionLoader, StrictUndefined, TemplateSyntaxError, UndefinedError
from jinja2 import Template as JinjaTemplate
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from robot_llm.prompting.template import Template, TemplateError

if TYPE_CHECKING:
    from robot_llm.prompting.context import RenderContext

__all__ = ["compile_template", "render_prompt"]


def _fmt(value: datetime | None, pattern: str) -> str:
    """Jinja filter ``fmt``: strftime, with '' for a missing date."""
    return "" if value is None else value.strftime(pattern)


def _rotate(items: Sequence[Any], by: int) -> list[Any]:
    """Jinja filter ``rotate``: the items started at ``by`` modulo their count (worked examples' order per prompt)."""
    items = list(items)
    if not items:
        return items
    k = int(by) % len(items)
    return items[k:] + items[:k]


def _environment(template: Template) -> ImmutableSandboxedEnvironment:
    # One environment per template, whose loader knows only that template: so Jinja's own
    # error messages and tracebacks carry the real file name, and the padding comment keeps
    # Jinja's line numbers equal to the file's (the body starts after the front matter).
    padding = "{#" + "\n" * (template.body_line - 1) + "#}"

    def load(name: str) -> tuple[str, str, Any] | None:
        if name != template.name:
            return None
        return padding + template.body, str(template.path), lambda: True

    # The immutable sandbox also refuses to modify lists and dicts from inside a template.
    env = ImmutableSandboxedEnvironment(
        loader=FunctionLoader(load),
        undefined=StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        auto_reload=False,
    )
    env.filters["fmt"] = _fmt
    env.filters["rotate"] = _rotate
    return env


_COMPILED: dict[tuple[Path, str], JinjaTemplate] = {}


def compile_template(template: Template) -> JinjaTemplate:
    """The compiled Jinja template, cached per file and body; a syntax error is a TemplateError with its line."""
    key = (template.path, template.body)
    compiled = _COMPILED.get(key)
    if compiled is None:
        try:
            compiled = _environment(template).get_template(template.name)
        except TemplateSyntaxError as exc:
            raise TemplateError(f"{template.path}:{exc.lineno}: template syntax error: {exc.message}") from None
        _COMPILED[key] = compiled
    return compiled


def _template_line(template: Template, tb: Any) -> int | None:
    """The template line a render error happened on (Jinja rewrites frames to template lines)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(template.path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def render_prompt(template: Template, context: RenderContext) -> str:
    """Render ``template`` with ``context``; a missing variable or sandbox violation is a TemplateError."""
    compiled = compile_template(template)
    try:
        return compiled.render(context.variables())
    except (UndefinedError, SecurityError) as exc:
        raise TemplateError(f"{_where(template)}: template {template.name!r}: {exc}") from None
    except Exception as exc:  # a filter or method misused in the template body: still the template's fault
        raise TemplateError(f"{_where(template)}: template {template.name!r}: {type(exc).__name__}: {exc}") from None


def _where(template: Template) -> str:
    line = _template_line(template, sys.exc_info()[2])
    return f"{template.path}:{line}" if line else str(template.path)
