"""The LLM-judge reward (RLAIF) of ``[trl] reward = "judge"``: a small local model scores
completions.

The judge is loaded once per rank, in-process, before training starts (loading under
``torch.random.fork_rng`` so that it never moves the training RNG: a resumed run must draw
the same numbers as an uninterrupted one) and scores one completion at a time in eval mode,
so a score is a pure function of (judge weights, prompt, completion), independent of the batch.

Two kinds of judge directory, told apart by its ``config.json``:

- a causal LM (``*ForCausalLM``, the LLM judge): asked "Is the answer correct? Reply yes or no."
  under its chat template; the score is P(yes) / (P(yes) + P(no)) of its next token;
- a sequence classifier with one label (``*ForSequenceClassification``, e.g. the checkpoint of
  a reward-model stage): the score is sigmoid(logit) of the prompt + answer conversation.

Which judge scored a run is recorded: :func:`identity` (path, kind, parameter count, sha256
of config.json and the weight files) goes into the ``reward_source`` event; a recipe may pin
it (``[trl.judge] expect_digest``) so that a stage handed the wrong judge refuses to start.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

QUESTION = "Question: {q}\nAnswer: {a}\nIs the answer correct? Reply yes or no."
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class JudgeError(RuntimeError):
    """A judge that cannot be used (missing, unknown kind, wrong digest): one clear line."""


def judge_dir(section) -> Path:
    """``[trl.judge] path``, or the tiny judge built locally from ``[trl.judge.model]``."""
    if section.path:
        path = Path(section.path).expanduser()
        if not (path / "config.json").is_file():
            raise JudgeError(f"[trl.judge] path {path}: not a model directory (no config.json)")
        return path
    from ptops.recipes.trl.model import model_dir

    return model_dir(section.model, seed=section.model.seed)


def weights_digest(path: Path) -> str:
    """sha256 over config.json and the weight files (names and bytes, sorted): the judge's
    identity."""
    h = hashlib.sha256()
    files = [path / "config.json"] + sorted(
        p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)
    )
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def judge_kind(path: Path) -> str:
    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "rm"
    if any(a.endswith("ForCausalLM") for a in archs):
        return "lm"
    raise JudgeError(
        f"[trl.judge] path {path}: architectures {archs} are neither *ForCausalLM nor "
        "*ForSequenceClassification"
    )


def _text(x) -> str:
    if isinstance(x, str):
        return x
    return "\n".join(str(m.get("content", "") or "") for m in x if isinstance(m, dict))


class Judge:
    """A loaded judge; ``score(prompt, completion)`` in [0, 1]."""

    def __init__(self, path: Path, max_chars: int = 2000) -> None:
        import torch
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

        self.path = Path(path)
        self.kind = judge_kind(self.path)
        self.max_chars = max_chars
        self.digest = weights_digest(self.path)
        with torch.random.fork_rng(devices=[]):
            cls = AutoModelForSequenceClassification if self.kind == "rm" else AutoModelForCausalLM
            self.model = cls.from_pretrained(
                str(self.path), dtype="float32", local_files_only=True
            ).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if self.kind == "lm":
            self.yes = self.tokenizer.encode("yes", add_special_tokens=False)[0]
            self.no = self.tokenizer.encode("no", add_special_tokens=False)[0]
            if self.yes == self.no:
                raise JudgeError(f"[trl.judge] path {path}: 'yes' and 'no' share their first token")
        self.params = sum(p.numel() for p in self.model.parameters())

    def identity(self) -> dict:
        return {
            "judge_path": str(self.path),
            "judge_kind": self.kind,
            "judge_digest": self.digest,
            "judge_params": self.params,
        }

    def _ids(self, messages: list[dict], generation_prompt: bool):
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        else:
            text = "\n".join(m["content"] for m in messages)
        return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    def score(self, prompt, completion) -> float:
        import torch

        q, a = _text(prompt), _text(completion)[: self.max_chars]
        with torch.inference_mode():
            if self.kind == "rm":
                ids = self._ids(
                    [{"role": "user", "content": q}, {"role": "assistant", "content": a}], False
                )
                return float(torch.sigmoid(self.model(input_ids=ids).logits[0, 0]))
            ids = self._ids([{"role": "user", "content": QUESTION.format(q=q, a=a)}], True)
            logits = self.model(input_ids=ids).logits[0, -1]
            pair = torch.stack([logits[self.yes], logits[self.no]]).double()
            return float(torch.softmax(pair, dim=0)[0])


class JudgeReward:
    """The GRPO reward function (TRL calls it with prompts and completions; logged as
    ``rewards/judge``)."""

    __name__ = "judge"

    def __init__(self, judge: Judge) -> None:
        self.judge = judge

    def __call__(self, prompts, completions, **_: object) -> list[float]:
        return [self.judge.score(p, c) for p, c in zip(prompts, completions)]


def load_judge(section) -> Judge:
    """The ``[trl.judge]`` judge, checked against ``expect_digest`` when the recipe pins one."""
    judge = Judge(judge_dir(section), max_chars=section.max_chars)
    if section.expect_digest and judge.digest != section.expect_digest:
        raise JudgeError(
            f"[trl.judge] expect_digest: the judge at {judge.path} has digest {judge.digest}, "
            f"not {section.expect_digest} (a different judge than the recipe names)"
        )
    return judge
