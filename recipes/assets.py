"""Tiny local assets: a BPE tokenizer and text / chat / preference / prompt data sets.

Nothing is downloaded: everything is generated from a seed and cached under
``$PTOPS_CACHE`` (default ``~/.cache/ptops``), built in a temporary folder and
renamed into place so that ranks building at the same moment never see half a
tokenizer. The arithmetic prompts double as GRPO's verifiable reward source.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

ASSETS_VERSION = 1
WORDS = (
    "the a one small large red blue green model token step rank loss grad check point save load node "
    "train run job time fast slow data batch layer head sum mean value check good bad new old this that "
    "when then after before every each run stops goes waits learns writes reads keeps moves"
).split()
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    return Path(os.environ.get("PTOPS_CACHE", Path.home() / ".cache" / "ptops"))


def _sentence(rng: random.Random) -> str:
    n = rng.randint(5, 14)
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.3:
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        words += [str(a), "plus", str(b), "is", str(a + b)]
    return " ".join(words).capitalize() + "."


def text_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English paragraphs (pre-training text)."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(n)]


def arithmetic_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        out.append((f"What is {a} plus {b}?", str(a + b)))
    return out


def chat_dataset(n: int = 256, seed: int = 1) -> list[dict]:
    """SFT conversations: ``{"messages": [...]}`` rows."""
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"The answer is {a}."}]}
        for q, a in arithmetic_pairs(n, seed)
    ]


def preference_dataset(n: int = 256, seed: int = 2) -> list[dict]:
    """DPO rows: ``{"prompt", "chosen", "rejected"}`` in conversational form."""
    rng = random.Random(seed + 1000)
    rows = []
    for q, a in arithmetic_pairs(n, seed):
        wrong = str(int(a) + rng.choice([-3, -2, -1, 1, 2, 3]))
        rows.append(
            {
                "prompt": [{"role": "user", "content": q}],
                "chosen": [{"role": "assistant", "content": f"The answer is {a}."}],
                "rejected": [{"role": "assistant", "content": f"The answer is {wrong}."}],
            }
        )
    return rows


def prompt_dataset(n: int = 256, seed: int = 3) -> list[dict]:
    """GRPO rows: ``{"prompt", "answer"}``; the reward checks the answer (verifiable)."""
    return [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in arithmetic_pairs(n, seed)]


def _train_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = text_corpus() + [q + " The answer is " + a + "." for q, a in arithmetic_pairs(2000, 9)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|pad|>"}, indent=2)
    )


def _build_once(name: str, builder) -> Path:
    """Build ``name`` under the cache once; concurrent callers race safely via rename."""
    root = cache_root() / f"v{ASSETS_VERSION}"
    final = root / name
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        builder(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def tokenizer_dir(vocab_size: int = 512) -> Path:
    """A folder with ``tokenizer.json`` (+ HF config and chat template) for ``vocab_size``."""
    return _build_once(f"tokenizer-{vocab_size}", lambda out: _train_tokenizer(vocab_size, out))


def digest_dir(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()
