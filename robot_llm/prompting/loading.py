"""Finding and loading template files: a configured folder first, then the templates shipped with robot-llm.

:func:`load_template` splits the front matter from the body, validates the front matter
(errors say ``file:line: key: message``, with YAML's own line numbers mapped back to the
file) and compiles the body: a broken template fails when it is loaded (the preflight
loads every configured one), not at 03:00 when the night renders it.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from robot_llm.config import AppConfig
from robot_llm.config_parsing import Yaml12SafeLoader, line_index, located, validation_message
from robot_llm.prompting.render import compile_template
from robot_llm.prompting.template import Template, TemplateError, TemplateHeader

__all__ = ["bundled_prompts_dir", "find_template", "load_template", "load_templates"]


def bundled_prompts_dir() -> Path:
    """The folder of the templates shipped with robot-llm.

    Installed, they are the package ``robot_llm.prompts``; in a source checkout, the
    repository's ``prompts/`` next to ``robot_llm/``.
    """
    try:
        root = importlib.resources.files("robot_llm.prompts")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "prompts"
    return Path(str(root))


def find_template(config: AppConfig, name: str) -> Path:
    """The file of template ``name``: ``config.prompts.dir`` first, else the bundled one."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise TemplateError(f"invalid template name {name!r} (letters, digits, '_', '-', '.')")
    for folder in (config.prompts.dir, bundled_prompts_dir()):
        candidate = folder / f"{name}.j2"
        if candidate.is_file():
            return candidate
    raise TemplateError(
        f"template {name!r} not found: no {name}.j2 in {config.prompts.dir} nor among the bundled templates"
    )


_FENCE = re.compile(r"^---[ \t]*$")


def load_template(path: str | Path) -> Template:
    """Read and validate one template file; errors say ``file:line: key: message``."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TemplateError(f"{source}: template file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"{source}: cannot read template: {exc}") from None
    lines = text.splitlines(keepends=True)
    if not lines or not _FENCE.match(lines[0].rstrip("\r\n")):
        raise TemplateError(f"{source}:1: a template starts with YAML front matter between two '---' lines")
    end = next((i for i in range(1, len(lines)) if _FENCE.match(lines[i].rstrip("\r\n"))), None)
    if end is None:
        raise TemplateError(f"{source}:1: the front matter is not closed by a '---' line")
    front = "".join(lines[1:end])
    body = "".join(lines[end + 1 :])
    offset = 1  # front matter line 1 is file line 2

    try:
        node = yaml.compose(front, Loader=Yaml12SafeLoader)
        data = yaml.load(front, Loader=Yaml12SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = (mark.line + 1 if mark else 0) + offset
        raise TemplateError(f"{source}:{line}: YAML syntax error: {exc.problem or exc.context}") from None
    if not isinstance(data, dict):
        raise TemplateError(f"{source}:2: the front matter must be a mapping (name, version, language, ...)")
    line_of = {key: line + offset for key, line in line_index(node)} if node is not None else {}
    try:
        header = TemplateHeader.model_validate(data)
    except ValidationError as exc:
        problems = [
            located(
                source,
                line_of,
                tuple(err["loc"]),
                "unknown key (check the spelling; see prompts/README.md)"
                if err["type"] == "extra_forbidden"
                else validation_message(err),
            )
            for err in exc.errors()
        ]
        raise TemplateError("\n".join(problems)) from None
    if header.name != path.stem:
        raise TemplateError(
            f"{source}:{line_of.get(('name',), 2)}: name: {header.name!r} does not match the file name {path.name!r}"
        )
    template = Template(**dict(header), path=path, body=body, body_line=end + 2)
    compile_template(template)  # a syntax error should surface at load time, not at 03:00
    return template


def load_templates(config: AppConfig) -> dict[str, Template]:
    """Every template named in ``config.prompts.templates``, loaded and compiled."""
    return {name: load_template(find_template(config, name)) for name in config.prompts.templates}
