"""Every promise the READMEs make in code: each fenced block and each ``robot-llm ...`` command runs.

README.md, then strategies/README.md (on the database the README's demo made).

* ``python`` blocks run as written, in a folder holding a ``robot-llm.yaml`` over a migrated
  database with a thesis in it (what a reader has after ``db upgrade`` and a night).
* Shell blocks run command by command through the real CLI; a ``$ `` line's output shown
  under it must be lines of the real output, in order (the README may leave lines out).
  ``FILE`` is that config and ``REV`` is ``-1``; nothing else is substituted.
* A few commands cannot run here and are named below with the reason; the test fails on any
  other block it does not know how to run, so a new README block gets a check with it.
* Inline ``robot-llm ...`` commands in the text parse with the real argument parser.
* The reader-only install, both ways the README gives, in a fresh virtual environment: it
  reads theses, and torch is nowhere (slow; it installs from the package index).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from robot_llm.commands.main import build_parser
from robot_llm.store.db import make_engine
from robot_llm.store.migrate import upgrade
from tests.conftest import DemoRun
from tests.forecasts.conftest import load_strategy, seed_thesis

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

# Commands that cannot run inside the test suite, and where they are checked instead.
NOT_RUN_HERE = {
    "bash scripts/install-and-test.sh": "the test command itself: it is what runs this test",
    "robot-llm model convert /data/": "needs the 200 GB YaLM-100B release (the converter runs on the tiny "
    "fixture in tests/engine/test_store.py)",
    "robot-llm model verify /nvme/": "needs the converted 200 GB store (verify runs in tests/engine/test_store.py)",
}
READER_INSTALL = ('pip install ".[', "pip wheel --no-deps -w dist .")


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    text: str


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text (indented ones in lists included)."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if m:
            indent, body, start = len(m.group(1)), [], i + 1
            i += 1
            while not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i][indent:])
                i += 1
            out.append(Block(start, m.group(2), "\n".join(body)))
        i += 1
    return out


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """A shell block's commands, each with the output the README shows under it (``$ `` blocks)."""
    lines = block.text.splitlines()
    if not any(line.startswith("$ ") for line in lines):
        return [(line, []) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif line.strip():
            out[-1][1].append(line)
    return out


def _strip_comment(command: str) -> str:
    return re.sub(r"\s+#.*$", "", command).strip()


@pytest.fixture
def reader_folder(tmp_path: Path) -> Path:
    """A folder with robot-llm.yaml over a migrated SQLite database holding an SBER thesis."""
    (tmp_path / "robot-llm.yaml").write_text(
        'database:\n  url: "sqlite:///robot-llm.sqlite"\ntimezone: "Europe/Moscow"\n'
        'instruments:\n  - ticker: "SBER"\n    name: "Сбербанк"\n'
        'model:\n  store: "store"\n  vocab: "voc.sp"\n',
        encoding="utf-8",
    )
    url = f"sqlite:///{tmp_path / 'robot-llm.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    now = datetime.now(timezone.utc)
    seed_thesis(engine, ticker="SBER", as_of=now - timedelta(hours=10), available_at=now - timedelta(hours=8))
    engine.dispose()
    return tmp_path


def _cli(command: str, cwd: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """Run ``robot-llm ...`` (or ``python ...``) with this interpreter; FILE is ``config``, REV is -1."""
    args = shlex.split(_strip_comment(command))
    assert args[0] in ("robot-llm", "python"), command
    rest = [str(config) if a == "FILE" else "-1" if a == "REV" else a for a in args[1:]]
    return subprocess.run(
        [sys.executable, *(["-m", "robot_llm.commands.main"] if args[0] == "robot-llm" else []), *rest],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
        check=False,
    )


def _shown_lines_in_order(shown: list[str], actual: str) -> None:
    real = [line.rstrip() for line in actual.splitlines()]
    at = 0
    for line in shown:
        try:
            at = real.index(line.rstrip(), at) + 1
        except ValueError:
            raise AssertionError(f"README shows {line!r}, not in the output (in order):\n{actual}") from None


def _check_fixture_output(shown: list[str], actual: str) -> None:
    """check-fixture prints JSON whose max_abs_diff is the CPU's rounding: equal within the 1e-4 contract."""
    (want,), got = [json.loads(line) for line in shown], json.loads(actual)
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] <= 1e-4 and value <= 1e-4, key
        else:
            assert got[key] == value, key


def _python_block(block: Block, where: str, folder: Path) -> bool:
    """Run a python block in ``folder``; False when it needs freqtrade and that is not installed here."""
    if "from freqtrade" in block.text and importlib.util.find_spec("freqtrade") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{where}: freqtrade must be installed in CI (pip install -e '.[freqtrade]')")
        return False
    load_strategy("freqtrade_adapter")  # robot_llm.strategies as installed, in a checkout too
    namespace: dict[str, object] = {"__name__": "__readme__"}
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(block.text, where, "exec"), namespace)
    finally:
        os.chdir(cwd)
    return True


def _run_blocks(path: Path, folder: Path, demo: DemoRun) -> int:
    """Run every block of the Markdown file ``path`` in ``folder``; returns how many ran.

    ``robot-llm demo`` is the session's one run of it (``demo``, in an empty folder as written),
    its working folder linked into ``folder``: the slowest command runs once per test session.
    """
    ran = 0
    for block in blocks(path.read_text(encoding="utf-8")):
        where = f"{path.relative_to(REPO)}:{block.line}"
        if block.lang == "python":
            ran += _python_block(block, where, folder)
            continue
        cmds = commands(block)
        if not any(c.startswith(("robot-llm", "bash ", "pip ", "python ")) for c, _ in cmds):
            assert block.text.startswith("feeds (RSS/Atom)"), f"{where}: a block this test does not know: {block}"
            continue  # the architecture diagram
        for command, shown in cmds:
            command = _strip_comment(command)
            if any(command.startswith(prefix) for prefix in NOT_RUN_HERE):
                continue
            if command.startswith(READER_INSTALL):
                continue  # test_reader_only_install runs these, in a fresh virtual environment
            if command == "bash scripts/install.sh && .venv/bin/robot-llm demo":
                # CI runs install.sh (install-and-test.sh calls it); the demo runs here, as a reader runs it.
                assert "bash scripts/install.sh" in (REPO / "scripts" / "install-and-test.sh").read_text()
                command = "robot-llm demo"
            if command == "robot-llm demo":
                assert "[5/5]" in demo.stdout  # it ran to the end (the fixture checked its exit code)
                if not (folder / "robot-llm-demo").exists():
                    (folder / "robot-llm-demo").symlink_to(demo.workdir, target_is_directory=True)
                ran += 1
                continue
            cwd = REPO if re.search(r"\s(config|tests)/", command) else folder
            proc = _cli(command, cwd, folder / "robot-llm.yaml")
            assert proc.returncode == 0, f"{where}: {command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            if command.startswith("robot-llm db downgrade"):
                upgrade(f"sqlite:///{folder / 'robot-llm.sqlite'}")  # for the blocks after it
            if shown and command.startswith("robot-llm model check-fixture"):
                _check_fixture_output(shown, proc.stdout)
            elif shown:
                _shown_lines_in_order(shown, proc.stdout)
            ran += 1
    return ran


@pytest.mark.slow
def test_every_readme_block_runs(reader_folder: Path, demo_run: DemoRun) -> None:
    # At least this many runnable commands and snippets in each.
    assert _run_blocks(README, reader_folder, demo_run) >= 10
    # strategies/README.md works on the demo's database.
    assert _run_blocks(REPO / "strategies" / "README.md", reader_folder, demo_run) >= 5


def test_inline_commands_parse(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``robot-llm ...`` in the README's text names a real command with real options.

    A mention by name (``robot-llm model convert``) may leave out required arguments.
    """
    parser = build_parser()
    text = README.read_text(encoding="utf-8")
    found = re.findall(r"`(robot-llm [^`]+)`", text)
    assert len(found) >= 15
    for command in found:
        words = shlex.split(command)[1:]
        # `forecasts show|export`, `--dtype fp16|bf16`: each alternative is a command.
        for argv in itertools.product(*(word.split("|") for word in words)):
            try:
                parser.parse_args(list(argv))
            except SystemExit:
                error = capsys.readouterr().err
                if "the following arguments are required" not in error:
                    pytest.fail(f"README mentions `{command}`, which the CLI refuses: {error}")


def _fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    return path / "bin"


@pytest.mark.slow
def test_reader_only_install(reader_folder: Path, tmp_path: Path) -> None:
    """The README's reader-only install, both ways as written, in a fresh virtual environment.

    Each way is followed by reading a thesis with torch nowhere to be found; between the two,
    robot-llm (not its dependencies, which both ways share) is uninstalled.
    """
    text = README.read_text(encoding="utf-8")
    ways = [c for b in blocks(text) for c, _ in commands(b) if c.startswith(READER_INSTALL)]
    assert len(ways) == len(READER_INSTALL)
    # A copy of the checkout: building writes build/ and dist/ next to the sources.
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "test-artifacts", "robot-llm-demo", "__pycache__"
        ),
    )
    bin_dir = _fresh_venv(tmp_path / "venv")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VIRTUAL_ENV": str(bin_dir.parent)}
    env.pop("PYTHONPATH", None)
    probe = (
        "import importlib.util, sys\n"
        "from datetime import datetime, timezone\n"
        "import robot_llm\n"
        "from robot_llm.forecasts import Forecasts\n"
        "assert importlib.util.find_spec('torch') is None, 'torch came with the reader install'\n"
        "with Forecasts.from_config('robot-llm.yaml') as fc:\n"
        "    t = fc.latest('SBER', datetime.now(timezone.utc))\n"
        "print(t.ticker, t.stance, robot_llm.__file__)\n"
        "assert 'torch' not in sys.modules\n"
    )
    for way in ways:
        proc = subprocess.run(
            ["bash", "-c", f"set -e; {way}"], cwd=source, env=env, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, f"{way}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        proc = subprocess.run(
            [str(bin_dir / "python"), "-c", probe], cwd=reader_folder, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        ticker, stance, location = proc.stdout.split()
        assert (ticker, stance) == ("SBER", "0.5")
        assert Path(location).is_relative_to(bin_dir.parent)  # the installed copy, not a checkout
        # The model stack is an extra: a command that needs it says which.
        proc = subprocess.run(
            [str(bin_dir / "robot-llm"), "demo", "--workdir", str(tmp_path / "demo")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines()[-1] == (
            "error: this command needs torch, which is not installed: pip install 'robot-llm[model]'"
        )
        subprocess.run([str(bin_dir / "pip"), "uninstall", "-y", "-q", "robot-llm"], env=env, check=True)
