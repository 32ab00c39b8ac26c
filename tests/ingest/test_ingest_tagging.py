"""Instrument tagging: whole words, Cyrillic boundaries, stems, patterns, the ticker's own rule."""

from __future__ import annotations

import pytest
from ingest_helpers import INSTRUMENTS

from robot_llm.config_sections import InstrumentConfig
from robot_llm.ingest.tagging import Tagger, TaggingError, word_forms

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


# --------------------------------------------------------------------------- Russian case forms

# Plain names only: every case form below is found through pymorphy3, no stem in sight.
INFLECTED = Tagger.from_instruments(
    [
        InstrumentConfig(ticker="SBER", name="Сбербанк", aliases=("Сбер",)),
        InstrumentConfig(ticker="GAZP", name="Газпром"),
        InstrumentConfig(ticker="MOEX", name="Московская биржа", aliases=("Мосбиржа",)),
        InstrumentConfig(ticker="GMKN", name="Норникель"),
        InstrumentConfig(ticker="VTBR", name="Банк ВТБ", aliases=("ВТБ",)),
        InstrumentConfig(ticker="MGNT", name="Магнит", aliases=("Волков",)),  # a made-up CEO Volkov
        InstrumentConfig(ticker="SMLT", name="Самолёт"),
    ]
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Набсовет Сбербанка рекомендовал дивиденды", ("SBER",)),
        ("Аналитики доверяют Сбербанку", ("SBER",)),
        ("Греф доволен Сбербанком; в Сбербанке рады", ("SBER",)),
        ("Сберу одобрили сделку", ("SBER",)),
        ("сбер запустил сервис", ("SBER",)),  # not an ordinary word: any case
        ("Акции Газпрома, отчёт о Газпроме", ("GAZP",)),
        ("Торги на Московской бирже", ("MOEX",)),
        ("Московскую биржу закрыли, Московской биржей довольны", ("MOEX",)),
        ("итоги московской\n биржи", ("MOEX",)),  # several words: any case, any spacing
        ("Мосбиржи и Мосбирже", ("MOEX",)),  # unknown to the dictionary: its forms are predicted
        ("Акции Норникеля выросли", ("GMKN",)),  # unknown too
        ("Банка ВТБ и ВТБ", ("VTBR",)),
        ("Сеть «Магнит» и акции Магнита", ("MGNT",)),
        ("МАГНИТА", ("MGNT",)),
        ("Интервью Волкова", ("MGNT",)),
        ("Самолета и Самолёту", ("SMLT",)),
        # false positives a trader does not want
        ("«Газпромнефть» и Газпромнефти отчитались", ()),  # another company
        ("Газпромбанк выпустил облигации Газпромбанка", ()),  # another company
        ("Сбережения граждан и сбережений", ()),  # not a form of Сбер
        ("Сберегательные счета", ()),
        ("ВТБ24 и ВТБшный", ()),  # an abbreviation inside a longer word
        ("втб", ()),  # an abbreviation keeps its capitals
        ("MOEXBC и SBERP и GAZPROM", ()),  # a ticker inside a longer word
        ("неодимовый магнит и два магнита", ()),  # the company's name as an ordinary noun
        ("Стая волков и волка видели", ()),  # the surname as the plural genitive of "волк"
        ("самолета и самолёт", ()),
    ],
)
def test_russian_names_match_their_case_forms(text: str, expected: tuple[str, ...]) -> None:
    assert INFLECTED.tag(text) == expected


def test_word_forms_of_known_and_unknown_names() -> None:
    forms, ordinary = word_forms("Сбербанк")
    assert {"сбербанк", "сбербанка", "сбербанку", "сбербанком", "сбербанке"} <= set(forms)
    assert "сбербанки" not in forms  # the alias's number only
    assert ordinary  # the dictionary has it as a common noun: capitals required
    # Unknown words: pymorphy3 predicts the paradigm from the ending (and "сбер" + "банк" above)
    for word, expected in [
        ("Мосбиржа", {"мосбиржа", "мосбиржи", "мосбирже", "мосбиржу", "мосбиржей"}),
        ("Норникель", {"норникель", "норникеля", "норникелю", "норникелем", "норникеле"}),
        ("Сбер", {"сбер", "сбера", "сберу", "сбером", "сбере"}),
    ]:
        forms, ordinary = word_forms(word)
        assert expected <= set(forms), word
        assert not ordinary, word
    # A feminine adjective keeps its gender; the surname reading of "Волков" wins over "волк"
    assert set(word_forms("Московская")[0]) >= {"московская", "московской", "московскую"}
    assert "московский" not in word_forms("Московская")[0]
    assert set(word_forms("Волков")[0]) == {"волков", "волкова", "волкову", "волковым", "волкове"}
    # The dictionary reads "Алроса" only as a genitive (of "алрос"): kept as written; "Алрос*" is the way
    assert word_forms("Алроса") == (("алроса",), False)


def test_tickers_and_aliases_that_are_not_one_plain_word() -> None:
    """Dots, several words with a stem, a phrase whose first word occurs alone: still whole, still exact."""
    tagger = Tagger.from_instruments(
        [
            InstrumentConfig(ticker="BRK.B", name="Berkshire Hathaway"),
            InstrumentConfig(ticker="MVID", name="М.Видео", aliases=("Эльдорадо Групп*",)),
            InstrumentConfig(ticker="MOEX", name="Московская биржа"),
        ]
    )
    assert tagger.tag("BRK.B up 2%") == ("BRK.B",)
    assert tagger.tag("BRK.BX and brk.b") == ()
    assert tagger.tag("Продажи М.Видео и Эльдорадо Группы") == ("MVID",)
    assert tagger.tag("ММ.Видео") == ()
    assert tagger.tag("Московская погода, биржа закрыта") == ()  # the first word alone is not the phrase
    assert tagger.tag("berkshire  hathaway") == ("BRK.B",)
