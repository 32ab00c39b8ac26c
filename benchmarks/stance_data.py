"""Rebuild ``benchmarks/data/stance/*.tsv`` from the public upstream files (what ``benchmarks/stance.py`` reads).

    python benchmarks/stance_data.py --tfns-train sent_train.csv --tfns-valid sent_valid.csv \
        --rusentne-train train_data.csv --rusentne-valid validation_data_labeled.csv

English: the "Twitter Financial News Sentiment" set (zeroshot, MIT; files ``sent_train.csv`` and
``sent_valid.csv``, labels 0 bearish, 1 bullish, 2 neutral). Russian: RuSentNE-2023
(dialogue-evaluation/RuSentNE-evaluation, MIT; ``train_data.csv`` and
``validation_data_labeled.csv``): news sentences labelled for their sentiment towards named
entities; a sentence is kept when it names an ORGANIZATION and every entity label in it agrees
(all 0, or the organisations' one non-zero sign), and takes that label. RuSentNE is general news
(politics, business, sport), not market news: it says whether a sentence is good or bad for an
organisation, which is the closest public, licence-clean Russian set found.

Per language, ``dev`` rows come from the upstream *train* split (for choosing templates and
calibration), ``eval`` rows from its *validation* split (for reporting): disjoint by construction.
Each is a class-balanced sample (fixed seed) of ``--per-class`` rows per label. Tweets lose their
``https://t.co/...`` links and ``$TICKER`` cashtags keep their text (a feed item has neither form).
"""

from __future__ import annotations

import argparse
import csv
import random
import re
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "stance"
TFNS_LABELS = {"0": -1, "1": 1, "2": 0}
LINK = re.compile(r"\s*https?://\S+")


def tfns(path: Path) -> list[tuple[int, str]]:
    """``(label, text)`` rows of a Twitter Financial News Sentiment CSV, links removed, duplicates dropped."""
    seen: set[str] = set()
    out = []
    with path.open(encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh):
            text = " ".join(LINK.sub("", row["text"]).split())
            if text and text not in seen:
                seen.add(text)
                out.append((TFNS_LABELS[row["label"]], text))
    return out


def rusentne(path: Path) -> list[tuple[int, str]]:
    """Sentence-level ``(label, text)`` rows of a RuSentNE-2023 TSV (see the module docstring for the rule)."""
    labels: dict[str, set[int]] = defaultdict(set)
    orgs: dict[str, set[int]] = defaultdict(set)
    with path.open(encoding="utf-8", newline="") as fh:
        for row in csv.DictReader(fh, delimiter="\t"):
            label = int(row["label"])
            labels[row["sentence"]].add(label)
            if row["entity_tag"] == "ORGANIZATION":
                orgs[row["sentence"]].add(label)
    out = []
    for sentence, found in orgs.items():
        if len(found) == 1 and labels[sentence] - {0} <= found:
            out.append((next(iter(found)), " ".join(sentence.split())))
    return out


def balanced(rows: list[tuple[int, str]], per_class: int, seed: int) -> list[tuple[int, str]]:
    """``per_class`` rows of each label (all of a smaller class), in a seeded random order."""
    rng = random.Random(seed)
    picked = []
    for label in (-1, 0, 1):
        pool = sorted(text for lab, text in rows if lab == label)
        rng.shuffle(pool)
        picked += [(label, text) for text in pool[:per_class]]
    rng.shuffle(picked)
    return picked


def write(name: str, lang: str, split: str, source: str, rows: list[tuple[int, str]]) -> None:
    path = OUT / name
    with path.open("w", encoding="utf-8", newline="") as fh:
        fh.write("# lang\tsplit\tlabel\tsource\ttext  (label: 1 positive, 0 neutral, -1 negative; see SOURCE.md)\n")
        for label, text in rows:
            fh.write(f"{lang}\t{split}\t{label}\t{source}\t{text}\n")
    print(f"{path}: {len(rows)} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tfns-train", type=Path, required=True)
    parser.add_argument("--tfns-valid", type=Path, required=True)
    parser.add_argument("--rusentne-train", type=Path, required=True)
    parser.add_argument("--rusentne-valid", type=Path, required=True)
    parser.add_argument("--per-class", type=int, default=60)
    parser.add_argument("--eval-per-class-en", type=int, default=80)
    parser.add_argument("--seed", type=int, default=22)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    sets = [
        ("en_dev.tsv", "en", "dev", "tfns-train", tfns(args.tfns_train), args.per_class),
        ("en_eval.tsv", "en", "eval", "tfns-valid", tfns(args.tfns_valid), args.eval_per_class_en),
        ("ru_dev.tsv", "ru", "dev", "rusentne-train", rusentne(args.rusentne_train), args.per_class),
        ("ru_eval.tsv", "ru", "eval", "rusentne-valid", rusentne(args.rusentne_valid), args.per_class),
    ]
    for name, lang, split, source, rows, per_class in sets:
        write(name, lang, split, source, balanced(rows, per_class, args.seed))


if __name__ == "__main__":
    main()
