"""Instrument tagging: whole words, Cyrillic boundaries, stems, patterns, the ticker's own rule."""

from __future__ import annotations

import pytest
from ingest_helpers import INSTRUMENTS

from robot_llm.config import InstrumentConfig
from robot_llm.ingest.tagging import Tagger, TaggingError

TAGGER = Tagger.from_instruments(InstrumentConfig(**i) for i in INSTRUMENTS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Russian inflection through a stem alias
        ("Набсовет Сбербанка рекомендовал дивиденды", ("SBER",)),
        ("Аналитики доверяют Сбербанку и Сбербанком довольны", ("SBER",)),
        ("СБЕРБАНКАМИ", ("SBER",)),
        ("«Газпром» увеличил экспорт", ("GAZP",)),
        ("бумаги ЛУКОЙЛа выросли", ("LKOH",)),
        ("Яндексу одобрили выпуск", ("YDEX",)),
        # the stem allows a case ending, not another word
        ("«Газпромнефть» отчиталась о добыче", ()),
        ("Газпромбанк выпустил облигации", ()),
        # a plain alias is a whole word in any case; Cyrillic letters bound it
        ("сбер запустил сервис", ("SBER",)),
        ("Сберегательные счета", ()),
        ("Pineapple and snapple are not Apple's rivals", ("AAPL",)),
        ("pineapple juice", ()),
        # the ticker: upper case, whole word only
        ("SBER +1.8%", ("SBER",)),
        ("$SBER и $GAZP", ("SBER", "GAZP")),
        ("SBERP preferred shares", ()),
        ("Turn it on, the lights are ON", ("ON",)),
        ("prices went on rising; ONE day; MOON; CONTROL", ()),
        ("ON Semiconductor beats", ("ON",)),
        # a pattern alias
        ("Nvidia's results", ("NVDA",)),
        ("NVIDIA and Apple Inc", ("AAPL", "NVDA")),
        ("nvidiafan forum", ()),
        ("в Сбербанке", ("SBER",)),
    ],
)
def test_tagging(text: str, expected: tuple[str, ...]) -> None:
    assert TAGGER.tag(text) == expected


def test_yo_and_ye_match_each_other() -> None:
    tagger = Tagger.from_instruments([InstrumentConfig(ticker="X", name="Хайтёк", aliases=("Самолёт*",))])
    assert tagger.tag("Хайтек и самолета") == ("X",)
    assert tagger.tag("Самолетостроение") == ()


def test_multiword_alias_matches_across_line_breaks() -> None:
    tagger = Tagger.from_instruments([InstrumentConfig(ticker="MGNT", name="Магнит", aliases=("Группа Магнит",))])
    assert tagger.tag("акции группа\n  магнит") == ("MGNT",)


def test_bad_pattern_names_the_instrument_and_alias() -> None:
    with pytest.raises(TaggingError, match=r"instruments\[BAD\]\.aliases: cannot use 're:\(unclosed'"):
        Tagger.from_instruments([InstrumentConfig(ticker="BAD", name="Bad", aliases=("re:(unclosed",))])
