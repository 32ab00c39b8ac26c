"""Tagging benchmark: items per second of ``Tagger.tag`` on the demo news and on generated news.

Tagging runs on every fetch of every feed, so its speed is the ingest's. Every configuration
runs in its own fresh process (single-threaded; the same environment for all), warms up on
the same items first, and is then timed ``--repeat`` times on:

* the demo news: the entries of the bundled demo feeds (parsed with the ingest's own
  ``parse_feed``), cycled to ``--demo-items`` items;
* ``--items`` generated news items: Russian and English headlines and summaries of news-like
  length, each naming one instrument in one of its case forms, or none (a near miss such as
  "Газпромнефть", "сбережения", or nothing at all), from a fixed seed.

Configurations, each on the demo config's instruments and on a 40-instrument MOEX universe:

* ``before``: the tagging module of another revision (``--before REV``, read with ``git show``):
  stems and patterns only;
* ``after``: this checkout's tagging module (plain Russian names in their case forms too).

It also times, in a fresh process, importing pymorphy3, constructing its MorphAnalyzer and
building the taggers (what the first ingest of a daemon pays once). The last line printed is
one JSON object with the figures.

    python benchmarks/tagging.py [--before REV] [--items 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "robot_llm" / "demo_data"

# A MOEX universe as a trader would configure it now: plain names, a few English aliases, stems
# only where the dictionary misreads a name ("Алроса", "Россети", "Русал").
UNIVERSE: list[tuple[str, str, tuple[str, ...]]] = [
    ("SBER", "Сбербанк", ("Сбер", "Sberbank")),
    ("GAZP", "Газпром", ("Gazprom",)),
    ("LKOH", "Лукойл", ("Lukoil",)),
    ("YDEX", "Яндекс", ("Yandex",)),
    ("ROSN", "Роснефть", ("Rosneft",)),
    ("NVTK", "Новатэк", ("Novatek",)),
    ("GMKN", "Норникель", ("Норильский никель", "Nornickel")),
    ("TATN", "Татнефть", ()),
    ("SNGS", "Сургутнефтегаз", ()),
    ("PLZL", "Полюс", ("Polyus",)),
    ("MGNT", "Магнит", ("Magnit",)),
    ("ALRS", "Алроса", ("Алрос*", "Alrosa")),
    ("CHMF", "Северсталь", ("Severstal",)),
    ("NLMK", "НЛМК", ()),
    ("MAGN", "ММК", ("Магнитогорский металлургический комбинат",)),
    ("MTLR", "Мечел", ()),
    ("AFLT", "Аэрофлот", ("Aeroflot",)),
    ("IRAO", "Интер РАО", ()),
    ("FEES", "Россети", ("Россет*",)),
    ("HYDR", "Русгидро", ("RusHydro",)),
    ("UPRO", "Юнипро", ()),
    ("MSNG", "Мосэнерго", ()),
    ("RTKM", "Ростелеком", ("Rostelecom",)),
    ("MTSS", "МТС", ()),
    ("FLOT", "Совкомфлот", ()),
    ("PHOR", "ФосАгро", ("PhosAgro",)),
    ("AKRN", "Акрон", ()),
    ("PIKK", "ПИК", ()),
    ("SMLT", "Самолёт", ()),
    ("LENT", "Лента", ()),
    ("OZON", "Ozon", ("Озон",)),
    ("VTBR", "Банк ВТБ", ("ВТБ",)),
    ("MOEX", "Московская биржа", ("Мосбиржа",)),
    ("AFKS", "АФК Система", ()),
    ("SGZH", "Сегежа", ()),
    ("RASP", "Распадская", ()),
    ("SELG", "Селигдар", ()),
    ("TRNFP", "Транснефть", ()),
    ("RUAL", "Русал", ("Русал*", "Rusal")),
    ("BELU", "Белуга", ()),
]

# The forms the generated news uses (written out, so that both configurations tag the same text).
FORMS: dict[str, list[str]] = {
    "SBER": ["Сбербанк", "Сбербанка", "Сбербанку", "Сбербанком", "Сбербанке", "Сбер", "Sberbank"],
    "GAZP": ["Газпром", "Газпрома", "Газпрому", "Газпромом", "Газпроме", "Gazprom"],
    "LKOH": ["Лукойл", "Лукойла", "Лукойлу", "ЛУКОЙЛ", "Lukoil"],
    "YDEX": ["Яндекс", "Яндекса", "Яндексу", "Яндексом", "Yandex"],
    "MOEX": ["Московская биржа", "Московской бирже", "Московскую биржу", "Мосбиржи"],
    "GMKN": ["Норникель", "Норникеля", "Норникелем"],
    "MGNT": ["Магнит", "«Магнита»", "Магниту"],
    "AAPL": ["Apple", "Apple Inc"],
    "NVDA": ["Nvidia", "Nvidia's"],
}
MISSES = ["Газпромнефть", "Газпромбанк", "сбережения", "магнит", "систему", "ленту", "самолёт", "Газпромнефти"]
RU_HEAD = [
    "Акции {x} выросли на {n}% после отчёта",
    "Аналитики повысили прогноз по бумагам: {x}",
    "Совет директоров — {x} — рекомендовал дивиденды",
    "{x} объявил о выкупе акций на {n} млрд рублей",
    "Инвесторы ждут решения по {x}",
]
EN_HEAD = ["Shares of {x} rose {n}% after results", "{x} announces a buyback", "Analysts upgrade {x}"]
FILLER = [
    "Рубль укрепился к доллару на фоне налогового периода.",
    "Индекс Мосбиржи завершил торги разнонаправленно, оборот составил {n} млрд рублей.",
    "Участники рынка оценивают решение Банка России по ключевой ставке.",
    "Нефть марки Brent подешевела на {n}% на фоне данных о запасах в США.",
    "Компания сообщила, что выплата состоится до конца года, а реестр закроют в декабре.",
    "Эксперты не исключают коррекции после сильного роста последних недель.",
    "The index closed mixed as investors weighed the central bank's decision.",
]


def generated_news(count: int, seed: int = 17) -> list[tuple[str, str]]:
    """``count`` (title, summary) pairs, the same for every configuration."""
    rng = random.Random(seed)
    tickers = sorted(FORMS)
    items = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.6:
            name = rng.choice(FORMS[rng.choice(tickers)])
        elif roll < 0.8:
            name = rng.choice(MISSES)
        else:
            name = "рынка"
        head = rng.choice(EN_HEAD if name.isascii() else RU_HEAD)
        title = head.format(x=name, n=rng.randint(1, 40))
        summary = " ".join(rng.choice(FILLER).format(n=rng.randint(1, 90)) for _ in range(rng.randint(2, 5)))
        items.append((title, summary))
    return items


def demo_news() -> list[tuple[str, str]]:
    from robot_llm.config_sections import FeedConfig
    from robot_llm.ingest.feeds import parse_feed
    from robot_llm.ingest.tagging import Tagger

    items = []
    untagged = Tagger.from_instruments([])
    for path in sorted((DEMO / "feeds").iterdir()):
        feed = FeedConfig(name=path.stem, url=str(path))
        parsed = parse_feed(path.read_bytes(), {"content-type": "application/xml"}, feed=feed, tagger=untagged)
        items.extend((e.title, e.summary) for e in parsed.entries)
    return items


def _instruments(which: str) -> list[Any]:
    from robot_llm.config import load_config
    from robot_llm.config_sections import InstrumentConfig

    if which == "demo":
        return list(load_config(DEMO / "demo.yaml").instruments)
    return [InstrumentConfig(ticker=t, name=n, aliases=a) for t, n, a in UNIVERSE]


def _load_tagging(path: str | None) -> Any:
    if path is None:
        from robot_llm.ingest import tagging

        return tagging
    spec = importlib.util.spec_from_file_location("tagging_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this (fresh) process: build, warm up, time."""
    tagging = _load_tagging(args.module)
    started = time.perf_counter()
    tagger = tagging.Tagger.from_instruments(_instruments(args.instruments))
    build_s = time.perf_counter() - started
    demo = demo_news()
    workloads = {
        "demo": [demo[i % len(demo)] for i in range(args.demo_items)],
        "generated": generated_news(args.items),
    }
    out: dict[str, Any] = {"build_s": round(build_s, 4), "demo_items": len(demo)}
    for name, items in workloads.items():
        for title, summary in items[:500]:  # warm-up: caches, regex compilation, branch predictors
            tagger.tag(title, summary)
        rates = []
        tagged = 0
        for _ in range(args.repeat):
            started = time.perf_counter()
            tagged = sum(1 for title, summary in items if tagger.tag(title, summary))
            rates.append(len(items) / (time.perf_counter() - started))
        out[name] = {"items": len(items), "tagged": tagged, "items_per_s": round(statistics.median(rates))}
    return out


def startup() -> dict[str, Any]:
    """What the first tagger of a process pays for pymorphy3 (fresh process)."""
    started = time.perf_counter()
    import pymorphy3

    imported = time.perf_counter()
    pymorphy3.MorphAnalyzer(lang="ru")
    constructed = time.perf_counter()
    return {"import_s": round(imported - started, 4), "analyzer_s": round(constructed - imported, 4)}


def _run(argv: list[str]) -> dict[str, Any]:
    # This checkout's robot_llm, whatever is installed; one thread and one hash seed for all.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        sys.exit(f"{' '.join(argv)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="git revision whose robot_llm/ingest/tagging.py is 'before'")
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--demo-items", type=int, default=3_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", choices=["tag", "startup"], help=argparse.SUPPRESS)
    parser.add_argument("--module", help=argparse.SUPPRESS)
    parser.add_argument("--instruments", default="demo", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "startup":
        print(json.dumps(startup()))
        return
    if args.child == "tag":
        print(json.dumps(child(args)))
        return

    common = ["--items", str(args.items), "--demo-items", str(args.demo_items), "--repeat", str(args.repeat)]
    configs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            old = Path(tmp) / "tagging_before.py"
            text = subprocess.run(
                ["git", "show", f"{args.before}:robot_llm/ingest/tagging.py"],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            ).stdout
            old.write_text(text, encoding="utf-8")
            configs["before"] = ["--module", str(old)]
        configs["after"] = []
        results: dict[str, Any] = {"startup": _run(["--child", "startup"])}
        print(
            f"pymorphy3: import {results['startup']['import_s'] * 1000:.0f} ms, "
            f"MorphAnalyzer {results['startup']['analyzer_s'] * 1000:.0f} ms (fresh process)",
            flush=True,
        )
        for instruments in ("demo", "moex40"):
            for name, extra in configs.items():
                key = f"{name}/{instruments}"
                res = _run(["--child", "tag", "--instruments", instruments, *common, *extra])
                results[key] = res
                demo, gen = res["demo"], res["generated"]
                print(
                    f"{key:16} build {res['build_s'] * 1000:7.1f} ms | demo news {demo['items_per_s']:>8,} items/s "
                    f"({demo['tagged']}/{demo['items']} tagged) | generated {gen['items_per_s']:>8,} items/s "
                    f"({gen['tagged']}/{gen['items']} tagged)",
                    flush=True,
                )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
