"""Loading and validating the YAML config: every bad input names the file, the line and the key."""

from __future__ import annotations

import os
import re
import textwrap
from datetime import time, timedelta
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from robot_llm.config import AppConfig, ConfigError, effective_config, load_config, parse_duration, parse_size

REPO = Path(__file__).resolve().parent.parent

BASE = """\
database:
  url: "sqlite:///robot-llm.sqlite"
timezone: "Europe/Moscow"
instruments:
  - ticker: "SBER"
    name: "Сбербанк"
    aliases: ["Сбербанк*"]
  - ticker: "GAZP"
    name: "Газпром"
feeds:
  - name: "interfax"
    url: "https://www.interfax.ru/rss.asp"
    interval: "15m"
  - name: "local"
    url: "feeds/local.xml"
    interval: "5m"
model:
  store: "store"
  vocab: "voc_100b.sp"
schedule:
  nightly: "0 23 * * 0-4"
  cutoff: "09:30"
"""


def write(tmp_path: Path, text: str, name: str = "robot-llm.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return str(err.value)


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing ``needle``, so tests do not hard-code numbers."""
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in config text")


def test_base_config_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, BASE))
    assert [i.ticker for i in config.instruments] == ["SBER", "GAZP"]
    assert config.feeds[0].interval == timedelta(minutes=15)
    assert config.schedule.cutoff == time(9, 30)
    assert config.source == (tmp_path / "robot-llm.yaml").resolve()


def test_example_config_is_valid() -> None:
    config = load_config(REPO / "config" / "robot-llm.example.yaml")
    assert config.timezone == "Europe/Moscow"
    tickers = [i.ticker for i in config.instruments]
    assert "ON" in tickers  # the YAML 1.1 trap, in the shipped example
    assert {i.exchange for i in config.instruments} >= {"MOEX", "NASDAQ"}
    assert any(a.endswith("*") for i in config.instruments for a in i.aliases)
    assert any(a.startswith("re:") for i in config.instruments for a in i.aliases)
    assert any(not f.url.startswith(("http://", "https://")) for f in config.feeds)
    assert config.signals.sources
    assert config.database.url == f"sqlite:///{REPO / 'config' / 'robot-llm.sqlite'}"


def test_example_documents_every_key() -> None:
    """Every key of the schema appears in the example with a comment on its line or just above."""
    lines = (REPO / "config" / "robot-llm.example.yaml").read_text(encoding="utf-8").splitlines()

    def keys(model: type, prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            if field.exclude:
                continue
            out.append(name)
            ann = field.annotation
            args = getattr(ann, "__args__", ())
            for sub in (ann, *args):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    out.extend(keys(sub))
        return out

    undocumented = []
    for key in sorted(set(keys(AppConfig))):
        pattern = re.compile(rf"^\s*(?:- )?#?\s*{re.escape(key)}:")
        hits = [i for i, line in enumerate(lines) if pattern.match(line)]
        if not any("#" in lines[i].split(":", 1)[1] or lines[i - 1].strip().startswith("#") for i in hits):
            undocumented.append(key)
    assert undocumented == []


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    msg = error_of(path)
    assert msg == f"{path}: config file not found"


def test_yaml_syntax_error_reports_line(tmp_path: Path) -> None:
    text = BASE.replace('    name: "Газпром"', '    name: "Газпром\n    exchange: [MOEX')
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}:")
    assert "YAML syntax error" in msg
    reported = int(msg.split(":")[1])
    assert line_of(text, "Газпром") <= reported <= line_of(text, "Газпром") + 3


@pytest.mark.parametrize(
    ("needle", "replacement", "key_path"),
    [
        ("timezone:", 'timzone: "UTC"\ntimezone:', "timzone"),
        ('    interval: "5m"', '    intervall: "5m"', "feeds[1].intervall"),
        ('  vocab: "voc_100b.sp"', '  vocab: "voc_100b.sp"\n  dtyp: "fp16"', "model.dtyp"),
    ],
)
def test_unknown_key(tmp_path: Path, needle: str, replacement: str, key_path: str) -> None:
    text = BASE.replace(needle, replacement, 1)
    path = write(tmp_path, text)
    msg = error_of(path)
    bad = key_path.rsplit(".", 1)[-1]
    assert msg.startswith(f"{path}:{line_of(text, bad + ':')}: {key_path}: unknown key")


def test_refill_slots_reach_the_runtime_and_refuse_negatives(tmp_path: Path) -> None:
    from robot_llm.night.model import model_settings

    text = BASE.replace('  vocab: "voc_100b.sp"', '  vocab: "voc_100b.sp"\n  refill_slots: 128')
    assert model_settings(load_config(write(tmp_path, text))).refill_slots == 128
    bad = BASE.replace('  vocab: "voc_100b.sp"', '  vocab: "voc_100b.sp"\n  refill_slots: -1')
    path = write(tmp_path, bad)
    assert error_of(path).startswith(f"{path}:{line_of(bad, 'refill_slots')}: model.refill_slots: ")


def test_wrong_type(tmp_path: Path) -> None:
    text = BASE.replace('  vocab: "voc_100b.sp"', '  vocab: "voc_100b.sp"\n  max_batch_size: lots')
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}:{line_of(text, 'max_batch_size')}: model.max_batch_size: ")
    assert "'lots'" in msg


def test_bad_duration(tmp_path: Path) -> None:
    text = BASE.replace('interval: "15m"', 'interval: "often"')
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg == f"{path}:{line_of(text, 'often')}: feeds[0].interval: expected a duration like '15m', got 'often'"


def test_invalid_cron(tmp_path: Path) -> None:
    text = BASE.replace('nightly: "0 23 * * 0-4"', 'nightly: "0 25 * * 0-4"')
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(
        f"{path}:{line_of(text, 'nightly')}: schedule.nightly: invalid cron expression '0 25 * * 0-4'"
    )


def test_cron_given_as_a_number(tmp_path: Path) -> None:
    text = BASE.replace('nightly: "0 23 * * 0-4"', "nightly: 5")
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}:{line_of(text, 'nightly')}: schedule.nightly: ")
    assert "quote it" in msg


def test_unknown_timezone(tmp_path: Path) -> None:
    text = BASE.replace('"Europe/Moscow"', '"Europe/Moskva"')
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}:{line_of(text, 'Moskva')}: timezone: unknown time zone 'Europe/Moskva'")


def test_duplicate_ticker(tmp_path: Path) -> None:
    text = BASE.replace('ticker: "GAZP"', 'ticker: "SBER"')
    path = write(tmp_path, text)
    msg = error_of(path)
    second = [i for i, line in enumerate(text.splitlines(), 1) if 'ticker: "SBER"' in line][1]
    assert msg == f"{path}:{second}: instruments[1].ticker: duplicate ticker 'SBER'"


def test_unset_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROBOT_LLM_TEST_UNSET", raising=False)
    text = BASE.replace('"sqlite:///robot-llm.sqlite"', '"postgresql://robot:${ROBOT_LLM_TEST_UNSET}@db/robot"')
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg == f"{path}:2: database.url: environment variable ${{ROBOT_LLM_TEST_UNSET}} is not set"


def test_environment_variables_set_and_defaulted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROBOT_LLM_TEST_PW", "s3cret")
    monkeypatch.delenv("ROBOT_LLM_TEST_HOST", raising=False)
    text = BASE.replace(
        '"sqlite:///robot-llm.sqlite"', '"postgresql://robot:${ROBOT_LLM_TEST_PW}@${ROBOT_LLM_TEST_HOST:-db.lan}/robot"'
    )
    config = load_config(write(tmp_path, text))
    assert config.database.url == "postgresql://robot:s3cret@db.lan/robot"


def test_database_folder_missing(tmp_path: Path) -> None:
    text = BASE.replace("sqlite:///robot-llm.sqlite", "sqlite:///no/such/folder/robot-llm.sqlite")
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg == f"{path}:2: database.url: the database folder {tmp_path / 'no/such/folder'} does not exist"


def test_database_folder_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "data").write_text("not a folder")
    text = BASE.replace("sqlite:///robot-llm.sqlite", "sqlite:///data/robot-llm.sqlite")
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}:2: database.url: the database folder {tmp_path / 'data'} is not a folder"


def test_database_folder_not_writable(tmp_path: Path) -> None:
    # Tests often run as root, for whom permission bits never refuse a write; sysfs refuses
    # file creation even to root, so it is a not-writable folder that works for everyone.
    folder = Path("/sys")
    if not folder.is_dir():
        pytest.skip("no /sys on this system")
    text = BASE.replace("sqlite:///robot-llm.sqlite", "sqlite:////sys/robot-llm.sqlite")
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}:2: database.url: the database folder /sys is not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="permission bits do not stop root")
def test_database_folder_without_write_permission(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        text = BASE.replace("sqlite:///robot-llm.sqlite", "sqlite:///ro/robot-llm.sqlite")
        msg = error_of(write(tmp_path, text))
    finally:
        folder.chmod(0o700)
    assert "the database folder" in msg and "is not writable" in msg


def test_yaml_11_traps(tmp_path: Path) -> None:
    text = BASE.replace('ticker: "GAZP"', "ticker: ON").replace(
        '    name: "Газпром"',
        "    name: ON Semiconductor\n  - ticker: NO\n    name: Norsk\n    aliases: [no, yes, off]",
    )
    text = text.replace('cutoff: "09:30"', "cutoff: 22:30")
    config = load_config(write(tmp_path, text))
    assert [i.ticker for i in config.instruments] == ["SBER", "ON", "NO"]
    assert config.instruments[2].aliases == ("no", "yes", "off")
    assert config.schedule.cutoff == time(22, 30)


def test_boolean_fields(tmp_path: Path) -> None:
    # A bool field still takes the words people write for one; only strings stay strings.
    for word, expected in (("true", True), ("yes", True), ("off", False)):
        text = BASE.replace(
            '  url: "sqlite:///robot-llm.sqlite"', f'  url: "sqlite:///robot-llm.sqlite"\n  echo: {word}'
        )
        assert load_config(write(tmp_path, text)).database.echo is expected
    text = BASE.replace('  url: "sqlite:///robot-llm.sqlite"', '  url: "sqlite:///robot-llm.sqlite"\n  echo: maybe')
    msg = error_of(write(tmp_path, text))
    assert msg.startswith(f"{tmp_path / 'robot-llm.yaml'}:3: database.echo: ") and "'maybe'" in msg


def test_omitted_sections_resolve_against_config_folder(tmp_path: Path) -> None:
    text = "instruments: [{ticker: SBER, name: Сбербанк}]\nmodel: {store: s, vocab: v.sp}\n"
    config = load_config(write(tmp_path, text))
    assert config.database.url == f"sqlite:///{tmp_path.resolve() / 'robot-llm.sqlite'}"
    assert config.prompts.dir == tmp_path.resolve() / "prompts"


def test_relative_paths_resolve_against_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("..") / "etc" / write(conf_dir, BASE).name)
    base = conf_dir.resolve()
    assert config.database.url == f"sqlite:///{base / 'robot-llm.sqlite'}"
    assert config.feeds[1].url == str(base / "feeds" / "local.xml")
    assert config.feeds[0].url == "https://www.interfax.ru/rss.asp"
    assert config.model.store == base / "store"
    assert config.model.vocab == base / "voc_100b.sp"
    assert config.prompts.dir == base / "prompts"


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, BASE))
    with pytest.raises(ValidationError):
        config.timezone = "UTC"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.instruments[0].ticker = "X"  # type: ignore[misc]
    assert isinstance(config.instruments, tuple)


def test_secrets_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PG_PASSWORD", "s3cret-from-env")
    text = BASE.replace('"sqlite:///robot-llm.sqlite"', '"postgresql://robot:${PG_PASSWORD}@db.lan:5432/robot"')
    text = text.replace('"https://www.interfax.ru/rss.asp"', '"https://user:hunter2@feeds.lan/rss"')
    data = effective_config(load_config(write(tmp_path, text)))
    dumped = repr(data)
    assert "s3cret-from-env" not in dumped and "hunter2" not in dumped
    assert data["database"]["url"] == "postgresql://robot:***@db.lan:5432/robot"
    assert data["feeds"][0]["url"] == "https://user:***@feeds.lan/rss"


def test_several_problems_reported_together(tmp_path: Path) -> None:
    text = BASE.replace('"Europe/Moscow"', '"Mars/Olympus"').replace('interval: "15m"', 'interval: "often"')
    msg = error_of(write(tmp_path, text))
    assert len(msg.splitlines()) == 2
    assert "timezone:" in msg and "feeds[0].interval:" in msg


def test_empty_and_non_mapping_files(tmp_path: Path) -> None:
    assert "is empty" in error_of(write(tmp_path, "# nothing\n"))
    assert "expected a mapping" in error_of(write(tmp_path, "- a\n- b\n"))


def test_parse_duration_and_size() -> None:
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("2h") == timedelta(hours=2)
    assert parse_duration(30) == timedelta(seconds=30)
    assert parse_size("64GiB") == 64 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    for bad in ("soon", True, -1):
        with pytest.raises(ValueError):
            parse_duration(bad)
    with pytest.raises(ValueError):
        parse_size("lots")


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    text = BASE + 'timezone: "UTC"\n'
    path = write(tmp_path, text)
    line = len(text.splitlines())
    assert (
        error_of(path)
        == f"{path}:{line}: YAML syntax error: duplicate key 'timezone' (it appears twice in this mapping)"
    )
