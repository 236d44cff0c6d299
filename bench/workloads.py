"""Seeded workloads of the serving benchmark, built from the model's own tokens.

Prompts are sequences of whole-word vocabulary tokens (``" word"`` pieces), so that
re-tokenizing the decoded text gives back close to the intended count; each
request records the prompt's real token count as the tokenizer sees it.

Datasets:

- ``random``: input and output lengths drawn uniformly from ranges.
- ``shared-prefix``: groups of requests that share one long system prompt, each
  with its own short question (agent and few-shot workloads).
- ``chat``: multi-turn conversations; turn ``k``'s prompt is turn ``k-1``'s prompt,
  a fixed assistant reply and a new user message. Replies are fixed text (not the
  engine's output) so every engine sees the same prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "DATASETS",
    "BenchRequest",
    "TokenText",
    "Workload",
    "WorkloadParams",
    "build_workload",
    "load_tokenizer",
    "parse_range",
]

DATASETS: tuple[str, ...] = ("random", "shared-prefix", "chat")


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def __len__(self) -> int: ...


class _FastTokenizer:
    """``tokenizers.Tokenizer`` with the few ``transformers``-style methods used here
    (loads in well under a second, without importing ``transformers``)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.eos_token_id: int | None = None
        for name in ("generation_config.json", "config.json", "tokenizer_config.json"):
            path = folder / name
            if self.eos_token_id is None and path.exists():
                cfg = json.loads(path.read_text())
                eos = cfg.get("eos_token_id", cfg.get("eos_token"))
                if isinstance(eos, dict):
                    eos = eos.get("content")
                if isinstance(eos, list):
                    eos = eos[0] if eos else None
                if isinstance(eos, int):
                    self.eos_token_id = eos
                elif isinstance(eos, str):
                    self.eos_token_id = self._tok.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size()


def load_tokenizer(folder: Path | None, gguf: Path | None = None) -> Any:
    """The model's tokenizer: from an HF folder's ``tokenizer.json``, else from the GGUF."""
    if folder is not None and (folder / "tokenizer.json").exists():
        return _FastTokenizer(folder)
    if gguf is None:
        raise FileNotFoundError("no tokenizer.json and no GGUF to read a tokenizer from")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def parse_range(text: str) -> tuple[int, int]:
    """``"64"`` → (64, 64); ``"200:300"`` → (200, 300)."""
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"bad length range {text!r}")
    return a, b


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_tokens: int
    output_tokens: int
    conversation: int = 0
    turn: int = 0


@dataclass
class WorkloadParams:
    dataset: str = "random"
    num_prompts: int = 16
    seed: int = 0
    input_len: tuple[int, int] = (200, 300)
    output_len: tuple[int, int] = (64, 64)
    # shared-prefix
    num_groups: int = 4
    system_len: int = 1024
    question_len: tuple[int, int] = (32, 64)
    # chat
    turns: int = 4
    user_len: tuple[int, int] = (48, 80)


@dataclass
class Workload:
    """Conversations of requests: within one, requests go in order; across, concurrently."""

    params: WorkloadParams
    conversations: list[list[BenchRequest]] = field(default_factory=list)

    @property
    def requests(self) -> list[BenchRequest]:
        return [r for conv in self.conversations for r in conv]

    def describe(self) -> dict[str, Any]:
        reqs = self.requests
        n = max(len(reqs), 1)
        return {
            **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.params).items()},
            "requests": len(reqs),
            "conversations": len(self.conversations),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in reqs) / n,
            "mean_output_tokens": sum(r.output_tokens for r in reqs) / n,
        }


class TokenText:
    """Makes text of a given token count from the tokenizer's whole-word tokens."""

    def __init__(self, tokenizer: _Tokenizer, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng
        words: list[int] = []
        for i in range(len(tokenizer)):
            s = tokenizer.decode([i])
            if len(s) >= 3 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
                words.append(i)
        if len(words) < 100:  # odd tokenizer: fall back to any non-empty printable piece
            words = [
                i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isprintable()
            ]
        self.words = words

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def make(self, n: int) -> str:
        """Text that the tokenizer reads as (about) ``n`` tokens."""
        ids = [self.rng.choice(self.words) for _ in range(n)]
        text = self.tok.decode(ids)
        for _ in range(4):
            got = self.tok.encode(text, add_special_tokens=False)
            if len(got) == n:
                break
            if len(got) > n:
                got = got[:n]
            else:
                got = got + [self.rng.choice(self.words) for _ in range(n - len(got))]
            text = self.tok.decode(got)
        return text


def _draw(rng: random.Random, lo_hi: tuple[int, int]) -> int:
    return rng.randint(lo_hi[0], lo_hi[1])


def build_workload(tokenizer: _Tokenizer, params: WorkloadParams) -> Workload:
    """The seeded workload of ``params.dataset``; identical for every engine."""
    rng = random.Random(params.seed)
    tt = TokenText(tokenizer, rng)
    w = Workload(params)
    if params.dataset == "random":
        for i in range(params.num_prompts):
            text = tt.make(_draw(rng, params.input_len))
            w.conversations.append(
                [BenchRequest(text, tt.count(text), _draw(rng, params.output_len), conversation=i)]
            )
    elif params.dataset == "shared-prefix":
        groups = max(1, min(params.num_groups, params.num_prompts))
        systems = [f"System: {tt.make(params.system_len)}\n" for _ in range(groups)]
        reqs: list[BenchRequest] = []
        for i in range(params.num_prompts):
            g = i % groups
            text = f"{systems[g]}User: {tt.make(_draw(rng, params.question_len))}\nAssistant:"
            reqs.append(
                BenchRequest(text, tt.count(text), _draw(rng, params.output_len), conversation=g)
            )
        rng.shuffle(reqs)  # groups interleave, as unrelated clients would
        w.conversations = [[r] for r in reqs]
    elif params.dataset == "chat":
        convs = max(1, -(-params.num_prompts // params.turns))
        left = params.num_prompts
        for c in range(convs):
            history = ""
            conv: list[BenchRequest] = []
            for t in range(min(params.turns, left)):
                history += f"User: {tt.make(_draw(rng, params.user_len))}\nAssistant:"
                out_len = _draw(rng, params.output_len)
                conv.append(
                    BenchRequest(history, tt.count(history), out_len, conversation=c, turn=t)
                )
                history += f"{tt.make(out_len)}\n"
            left -= len(conv)
            w.conversations.append(conv)
    else:
        raise ValueError(f"unknown dataset {params.dataset!r}; one of {', '.join(DATASETS)}")
    return w
