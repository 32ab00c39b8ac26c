"""``robot-llm model check-reference``: our Gemma 3 270M against transformers on the same GGUF weights.

Both sides read the packaged ``gemma-3-270m-q4_k_m.gguf``: ours through the production
importer (fp32 store, tokenizer rebuilt from the metadata) and the door (:meth:`robot_llm.llm.model.Model.open`:
the streaming engine, fp32, layers in RAM);
transformers (the ``dev`` extra; never imported elsewhere) through its own GGUF loader,
in fp32 with eager attention. Checked: token ids on a mixed Russian/English corpus
(newlines, digits, emoji), the logits at every position of three prompts (one longer
than 600 tokens, so the 512-token sliding window is exercised) and 32 greedy tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from robot_llm.errors import RobotLLMError

log = logging.getLogger(__name__)

#: Bounds the check must meet (issue: fp32, dequantised weights).
LOGIT_TOLERANCE = 1e-3
GREEDY_TOKENS = 32

TOKENIZER_CORPUS = [
    "Сбербанк отчитался о рекордной прибыли: 1 234,5 млрд руб. (+12%) 🚀",
    "Nasdaq futures rose 1.2% after the Fed held rates at 5.25–5.50%.\n\nAnalysts expect a cut in 2026.",
    "Акции «Газпрома» упали на 3,7% — инвесторы опасаются санкций 😟\nUSD/RUB = 92.15",
    "  Leading spaces, tabs\tand trailing spaces   ",
    "Mixed: курс ЦБ 90₽ vs $1; emoji 👍🏽🇷🇺; digits 0123456789; URL https://moex.com/ru/index/IMOEX",
    "Строка1\r\nСтрока2\n\n\nКонец.",
]

ENGLISH_PROMPT = (
    "Market news, 12 March 2026.\n"
    "Apple shares rose 4% after the company reported record iPhone sales in China. "
    "Analysts at Morgan Stanley raised their price target. Outlook for Apple stock:"
)
RUSSIAN_PROMPT = (
    "Новости рынка, 12 марта 2026 года.\n"
    "Акции Сбербанка выросли на 3% после публикации рекордной квартальной прибыли. "
    "Банк сохранил прогноз по дивидендам. Прогноз для акций Сбербанка:"
)


def long_prompt(min_tokens: int, tokenizer: Any) -> str:
    """A news digest just over ``min_tokens`` tokens, line by line from the bundled demo feeds' text."""
    from importlib import resources

    feeds = resources.files("robot_llm") / "demo_data" / "feeds"
    lines = []
    for item in sorted(feeds.iterdir(), key=lambda p: p.name):
        raw = item.read_bytes()
        text = raw.decode("cp1251") if "1251" in item.name else raw.decode("utf-8")
        lines += [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    text = "Overnight digest."
    for line in lines * (1 + min_tokens // 8):
        if len(tokenizer.encode(text)) > min_tokens:
            break
        text += "\n" + line
    return text + "\nSummary:"


def check_gemma(gguf: Path, store_dir: Path) -> dict[str, Any]:
    """Run the comparison; returns ``max_abs_diff``, ``tokens_match``/``tokens_total``,
    ``greedy_match``/``greedy_total``, ``long_prompt_tokens``."""
    import torch

    from robot_llm.llm.generate import SamplingParams
    from robot_llm.llm.model import Model, ModelSettings
    from robot_llm.llm.store.importers import import_model
    from robot_llm.llm.store.reader import MANIFEST

    try:
        import transformers
    except ImportError as exc:
        raise RobotLLMError("check-reference needs transformers (pip install -e '.[dev]')") from exc
    if not (store_dir / MANIFEST).is_file():
        import_model(gguf, store_dir, dtype="fp32")
    # Planned for this check's work (one prompt at a time, the long one within 1024 positions), not a night's.
    settings = ModelSettings(
        vocab=store_dir,
        store=store_dir,
        home="ram",
        device="cpu",
        dtype="fp32",
        max_batch_size=1,
        max_new_tokens=GREEDY_TOKENS,
        max_positions=1024,
    )
    ours = Model.open(settings)
    tokenizer = ours.tokenizer
    with _gguf_parsed_once():
        ref_tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    tokens_match = sum(tokenizer.encode(text) == ref_tok(text).input_ids for text in TOKENIZER_CORPUS)
    prompts = [ENGLISH_PROMPT, RUSSIAN_PROMPT, long_prompt(650, tokenizer)]
    max_diff, greedy_match = 0.0, 0
    try:
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            with torch.no_grad():
                want = ref(torch.tensor([ids])).logits[0]
            got = ours.engine.forward(torch.tensor([ids]))[0]
            max_diff = max(max_diff, float((got - want).abs().max()))
            with torch.no_grad():
                ref_new = ref.generate(
                    torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_id
                )[0, len(ids) :].tolist()
            mine = ours.generate([prompt], SamplingParams(max_new_tokens=GREEDY_TOKENS, greedy=True))[0]
            greedy_match += list(mine.token_ids) == ref_new
            log.info("prompt of %d tokens: max |dlogit| %.2e, greedy %s", len(ids), max_diff, mine.text[:60])
    finally:
        ours.close()
    return {
        "max_abs_diff": max_diff,
        "tokens_match": tokens_match,
        "tokens_total": len(TOKENIZER_CORPUS),
        "greedy_match": greedy_match,
        "greedy_total": len(prompts),
        "long_prompt_tokens": len(tokenizer.encode(prompts[2])),
    }


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers opens the GGUF three times (tokenizer, config, weights), and gguf-py's reader takes about
    20 s a time over the 262k-token vocabulary's metadata; inside this block each file is parsed once (the reader
    is a read-only view of the file, so sharing it changes nothing transformers sees)."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[str, Any] = {}

    def shared(path: str | Path, mode: str = "r") -> Any:
        key = f"{Path(path).resolve()}:{mode}"
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


def passed(result: dict[str, Any]) -> bool:
    """True when every bound holds."""
    return (
        result["max_abs_diff"] <= LOGIT_TOLERANCE
        and result["tokens_match"] == result["tokens_total"]
        and result["greedy_match"] == result["greedy_total"]
    )
