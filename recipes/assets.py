"""Tiny local assets: a BPE tokenizer and text / chat / preference / prompt data sets.

Nothing is downloaded: everything is generated from a seed and cached under
``$PTOPS_CACHE`` (default ``~/.cache/ptops``). Every cached asset goes through
:func:`build_once`: one process builds (a file lock that the other ranks and runs wait
on), into a temporary folder; the asset must pass its own check (it loads) before a
manifest marks it complete and a rename publishes it; an entry that does not match its
manifest is quarantined and rebuilt. The arithmetic prompts double as GRPO's
verifiable reward source.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ptops.ops.runrecord import ranklog
from ptops.ops.runrecord.cache import cache_root  # also this module's API

ASSETS_VERSION = 1
WORDS = (
    "the a one small large red blue green model token step rank loss grad check point save load "
    "node "
    "train run job time fast slow data batch layer head sum mean value check good bad new old "
    "this that "
    "when then after before every each run stops goes waits learns writes reads keeps moves"
).split()
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% "
    "endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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
        {
            "messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": f"The answer is {a}."},
            ]
        }
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
    return [
        {"prompt": [{"role": "user", "content": q}], "answer": a}
        for q, a in arithmetic_pairs(n, seed)
    ]


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


class AssetError(RuntimeError):
    """An asset that fails its own check: a fresh build (never marked complete) or a cache entry."""


MARKER = ".complete"
QUARANTINE = ".quarantine"
LEGACY = f"{MARKER} is not a manifest (marked complete without a check)"


def sha256_file(path: Path) -> str:
    """A file's sha256, read in 1 MiB chunks (asset manifests; rejection sampling's SFT rows)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(path: Path) -> dict:
    files = {
        str(p.relative_to(path)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    return {"assets_version": ASSETS_VERSION, "files": files}


def untrusted(path: Path) -> str | None:
    """Why the entry at ``path`` cannot be used as is (None: usable). The marker is a manifest
    written only after the asset passed its check, so bytes that match it are the bytes that loaded;
    a bare marker (written before assets checked themselves, e.g. by a rank that saved no weights)
    is not."""
    if not path.exists():
        return "missing"
    try:
        manifest = json.loads((path / MARKER).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MARKER} marker (an unfinished build)"
    except (ValueError, KeyError, TypeError):
        return LEGACY
    if not files:
        return f"{MARKER} names no files"
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != want["size"] or sha256_file(f) != want["sha256"]:
            return f"{rel} differs from its manifest"
    return None


def quarantine(path: Path, reason: str) -> Path:
    """Move a bad entry aside (kept for a look, never loaded) so that it is rebuilt."""
    qdir = path.parent / QUARANTINE
    qdir.mkdir(parents=True, exist_ok=True)
    dest = (
        qdir / f"{path.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )
    os.rename(path, dest)
    (dest / "QUARANTINED").write_text(reason + "\n")
    ranklog.get("assets").warning("quarantined %s -> %s: %s; rebuilding", path, dest, reason)
    return dest


@contextmanager
def _build_lock(root: Path, name: str):
    """One builder per asset and cache: an exclusive ``flock`` that others (ranks, runs) wait on;
    the kernel drops it when its holder dies. Where the file system has no locks, the check before
    the rename still keeps incomplete entries out."""
    locks = root / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. ENOLCK on some network file systems
        yield
    finally:
        os.close(fd)  # releases the lock


def build_once(name: str, builder: Callable[[Path], None], check: Callable[[Path], None]) -> Path:
    """The cache entry ``name``: used when it matches its manifest, else built by one process while
    the others wait. ``builder(tmp)`` writes into a temporary folder, ``check(tmp)`` must load it
    (raise on anything missing), then the manifest marks it complete and one rename publishes it. An
    entry that does not match its manifest is quarantined and rebuilt, never trusted; one of an
    older ptops (a bare marker) is kept only if it passes the check."""
    root = cache_root() / f"v{ASSETS_VERSION}"
    final = root / name
    if untrusted(final) is None:
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root, name):
        reason = untrusted(final)
        if reason is None:
            return final  # built by the holder we waited for
        if reason == LEGACY and _adopted(final, check):
            return final
        if final.exists():
            quarantine(final, reason)
        for stale in root.glob(
            f".{name}-{'?' * 8}"
        ):  # mkdtemp folders of builders that died (we hold
            shutil.rmtree(stale, ignore_errors=True)  # the lock: nobody else builds this name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            builder(tmp)
            try:
                check(tmp)
            except Exception as e:  # any load error means incomplete
                raise AssetError(
                    f"asset {name}: the fresh build fails its check, not cached: "
                    f"{type(e).__name__}: {e}"
                ) from e
            _mark_complete(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if untrusted(final) is not None:  # only without a working lock can another have won
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _adopted(path: Path, check: Callable[[Path], None]) -> bool:
    """An entry of an older ptops (bare marker) is kept when it passes today's check (a poisoned one
    does not)."""
    try:
        check(path)
    except Exception:  # any load error: not adopted (quarantined by the caller)
        return False
    _mark_complete(path)
    ranklog.get("assets").info("checked %s (built by an older ptops): it loads; kept", path)
    return True


def _mark_complete(path: Path) -> None:
    marker = path / (MARKER + ".tmp")
    marker.write_text(json.dumps(_manifest(path), indent=1))
    os.rename(marker, path / MARKER)


def _check_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise AssetError(f"special tokens {missing} are not in the vocabulary")
    if tok.decode(tok.encode("one plus two is 3.").ids) != "one plus two is 3.":
        raise AssetError("the tokenizer does not round-trip a sentence")
    config = json.loads((path / "tokenizer_config.json").read_text())
    if config.get("chat_template") != CHAT_TEMPLATE:
        raise AssetError("tokenizer_config.json has no (or another) chat template")
    json.loads((path / "special_tokens_map.json").read_text())


def tokenizer_dir(vocab_size: int = 512) -> Path:
    """A folder with ``tokenizer.json`` (+ HF config and chat template) for ``vocab_size``."""
    return build_once(
        f"tokenizer-{vocab_size}", lambda out: _train_tokenizer(vocab_size, out), _check_tokenizer
    )


def digest_dir(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()
