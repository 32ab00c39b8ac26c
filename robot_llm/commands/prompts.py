"""``robot-llm prompts render``: exactly the prompt a request would get, its token count and the news left out."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from robot_llm.clock import parse_as_of
from robot_llm.errors import RobotLLMError
from robot_llm.night.plan import render_for, tokenizer_for
from robot_llm.prompting.loading import find_template, load_template
from robot_llm.store.db import error_line, session_scope, utcnow

__all__ = ["register"]


def _render_command(args: argparse.Namespace) -> int:
    from robot_llm.commands.common import load_app_config, open_database

    config = load_app_config(args)
    try:
        instrument = config.instrument(args.ticker)
    except KeyError:
        known = ", ".join(i.ticker for i in config.instruments)
        raise RobotLLMError(f"--ticker: unknown ticker {args.ticker!r} (configured: {known})") from None
    name = args.template or config.prompts.templates[0]
    template = load_template(find_template(config, name))
    as_of = parse_as_of(args.as_of, config.tz) if args.as_of else utcnow()
    tokenizer = tokenizer_for(config)
    engine = open_database(config)
    try:
        with session_scope(engine) as session:
            result = render_for(session, config, template, instrument, as_of, tokenizer)
    except SQLAlchemyError as exc:
        raise RobotLLMError(
            f"cannot read news and signals from the database: {error_line(exc)} "
            f"(is it migrated? run `robot-llm db upgrade -c {args.config}`)"
        ) from None
    finally:
        engine.dispose()

    # stdout carries the prompt byte for byte (redirect it to get exactly what is sent);
    # the facts about it go to stderr.
    sys.stdout.write(result.prompt)
    sys.stdout.flush()
    local = as_of.astimezone(config.tz)
    gen = result.generation
    err = sys.stderr
    print("", file=err)
    print(f"# template {template.name} v{template.version} ({template.path})", file=err)
    print(f"# ticker {instrument.ticker}, as_of {local.isoformat()} ({as_of.isoformat()})", file=err)
    print(
        f"# prompt tokens: {result.prompt_tokens} (BOS included) of a budget of {result.budget} "
        f"(max_positions {config.model.max_positions}, max_new_tokens {gen.max_new_tokens})",
        file=err,
    )
    print(f"# news shown: {len(result.news_ids)}, signals shown: {len(result.signal_ids)}", file=err)
    print(f"# sha256 {result.prompt_sha256}", file=err)
    if result.dropped:
        print(f"# dropped news: {len(result.dropped)}", file=err)
        for item in result.dropped:
            entry = item.entry
            when = entry.at.astimezone(config.tz).strftime("%Y-%m-%d %H:%M")
            title = " ".join(entry.title.split())[:100]
            print(f"#   id {entry.id} ({item.reason}, mentions {entry.mentions}) {when} {title}", file=err)
    else:
        print("# dropped news: none", file=err)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``robot-llm prompts render``."""
    prompts = sub.add_parser("prompts", help="prompt templates")
    prompts_sub = prompts.add_subparsers(dest="prompts_command", metavar="COMMAND", required=True)
    render = prompts_sub.add_parser(
        "render",
        parents=[common],
        help="print exactly the prompt that would be sent for one instrument, and its token count",
        description=(
            "Render a template for one instrument from the database as of a cut-off. The prompt goes to "
            "stdout exactly as it would be sent; its token count and the news left out go to stderr."
        ),
    )
    render.add_argument("--ticker", required=True, help="the instrument's ticker")
    render.add_argument("--template", help="template name (default: the first in prompts.templates)")
    render.add_argument(
        "--as-of",
        help="cut-off, ISO 8601; without an offset it is in the config's timezone (default: now)",
    )
    render.set_defaults(handler=_render_command)
