"""The tokenizer's text side: loading (HF folder or GGUF), encoding, chat templates, decoding.

Pure code, no asyncio or zmq: ``TokenizerActor`` wraps it.

Thread safety: ``encode`` may run in worker threads while the event loop keeps
decoding. HF fast tokenizers are safe to share across threads as long as nobody
changes their truncation/padding state, which the transformers front end may do
on every call; so with a fast backend we call the Rust ``tokenizers.Tokenizer``
directly, and through ``encode_batch``, which also releases the GIL (a plain
``encode`` holds it for the whole call and would stall the event loop on long
inputs). Tokenizers without a fast backend are serialised with a lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from actorlm.messages.generate import ChatMessage

__all__ = [
    "END_OF_TURN_TOKENS",
    "ChatTemplateError",
    "TextTokenizer",
    "default_cache_root",
    "gguf_tokenizer_dir",
    "load_tokenizer",
]

_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class ChatTemplateError(ValueError):
    """The chat could not be rendered (no template, or the template rejected it): a client error."""


def default_cache_root() -> Path:
    # Not $XDG_CACHE_HOME: configuration reads no environment (see config.py);
    # callers that want another place pass ``cache_root``.
    return Path.home() / ".cache" / "actorlm" / "tokenizers"


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: each byte is shown as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TextTokenizer:
    """An HF tokenizer plus what serving needs: eos ids, special-id sets, window decoding."""

    def __init__(self, hf: Any, eos_token_ids: Iterable[int] = (), source: str = "") -> None:
        self.hf = hf
        self.source = source
        backend = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
        # The Rust tokenizer when there is one: thread-safe, batch decode, GIL released.
        self.backend: Any = backend
        self._lock = threading.Lock()  # only for tokenizers without a fast backend
        ids = set(eos_token_ids)
        if hf.eos_token_id is not None:
            ids.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.special_ids: frozenset[int] = frozenset(int(i) for i in hf.all_special_ids) | {
            int(i) for i, tok in hf.added_tokens_decoder.items() if tok.special
        }
        self.vocab_size: int = len(hf)
        self._byte_level = False
        if backend is not None:
            from tokenizers import decoders

            self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._unicode_to_byte = _gpt2_unicode_to_byte() if self._byte_level else {}
        # Token strings and bytes for logprobs, filled lazily; dict writes are atomic
        # under the GIL.
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    # -- encoding ---------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Thread-safe; releases the GIL with a fast backend."""
        if self.backend is not None:
            return list(
                self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            )
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if template else None

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text of a chat, rendered by the model's own jinja template."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"the model at {self.source or 'this path'} has no chat template; "
                "send a plain prompt (completions) instead of messages"
            )
        conversation = [_message_dict(m) for m in messages]
        try:
            text = self.hf.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
            raise ChatTemplateError(f"chat template failed: {e}") from e
        if not isinstance(text, str):
            raise ChatTemplateError(f"chat template returned {type(text).__name__}, not text")
        return text

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of a chat. The template writes its own BOS, so no special tokens are added."""
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # -- decoding ---------------------------------------------------------------

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings (``ĠHello``, ``<|im_end|>``), not display text."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(ids))]

    def decode_windows(self, windows: Sequence[Sequence[int]]) -> list[str]:
        """Decode many short id lists in one call, special tokens kept (callers filter first)."""
        if not windows:
            return []
        if self.backend is not None:
            return list(
                self.backend.decode_batch([list(w) for w in windows], skip_special_tokens=False)
            )
        with self._lock:
            return [self.hf.decode(list(w), skip_special_tokens=False) for w in windows]

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Whole-sequence decode; what streaming through ``IncrementalDetokenizer`` adds up to.

        Kept special tokens with ``spaces_between_special_tokens`` are joined to the
        text around them with one space, as HF's Python tokenizers do (its fast ones
        ignore the flag).
        """
        kept = [i for i in ids if not (skip_special_tokens and i in self.special_ids)]
        if skip_special_tokens or not spaces_between_special_tokens:
            return self.decode_windows([kept])[0]
        segments: list[list[int]] = []
        for i in kept:
            if i in self.special_ids or not segments or segments[-1][-1] in self.special_ids:
                segments.append([i])
            else:
                segments[-1].append(i)
        return " ".join(self.decode_windows(segments))

    def token_text(self, token_id: int) -> str:
        """Display text of one token, as OpenAI logprobs show it (``" Hello"``; ``"�"`` for a
        token holding part of a character; special tokens by name)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.decode_windows([[token_id]])[0]
            self._token_text[token_id] = text
        return text

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """``token_text`` for many ids, decoding the uncached ones in one batch."""
        missing = sorted({i for i in ids if i not in self._token_text})
        for i, text in zip(missing, self.decode_windows([[i] for i in missing]), strict=True):
            self._token_text[i] = text
        return [self._token_text[i] for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (OpenAI's logprob ``bytes``): exact even when
        the token is only part of a UTF-8 character."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id in self.special_ids:
            return self.token_text(token_id).encode()
        piece = self.convert_ids_to_tokens([token_id])[0]
        if self._byte_level and all(c in self._unicode_to_byte for c in piece):
            return bytes(self._unicode_to_byte[c] for c in piece)
        m = _BYTE_FALLBACK_TOKEN.match(piece)
        if m:  # sentencepiece byte fallback, <0xE4>
            return bytes([int(m.group(1), 16)])
        return self.token_text(token_id).encode()


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        # OpenAI content parts: a text-only engine renders them as one string, since
        # most templates concatenate ``content`` and would print a list's repr.
        texts: list[str] = []
        for part in content:
            if part.get("type") != "text":
                raise ChatTemplateError(f"unsupported content part type {part.get('type')!r}")
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _config_eos_ids(folder: Path) -> set[int]:
    """eos ids a model declares beyond the tokenizer's (Llama 3 lists several)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


# End-of-turn tokens of the chat formats, by their text: a GGUF lists its eos (and
# perhaps eot/eom) ids, but a chat model ends its turns with one of these; llama.cpp
# treats them as end of generation the same way.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|end|>", "<|eot_id|>", "<|eom_id|>")


def _gguf_stop_ids(gguf_path: Path, hf: Any) -> set[int]:
    """The file's eos/eot/eom ids, and the ids of the end-of-turn tokens its vocabulary has."""
    from actorlm.gpu.gguf_file import GGUFFile

    meta = GGUFFile(gguf_path).metadata
    ids = {
        int(meta[k])
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if isinstance(meta.get(k), int)
    }
    vocab = hf.get_vocab()
    return ids | {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}


def gguf_tokenizer_dir(gguf_path: str | os.PathLike[str], cache_root: Path | None = None) -> Path:
    """An HF tokenizer folder converted from a GGUF's metadata, cached.

    Conversion takes seconds, so the result is kept under ``cache_root`` keyed by
    the file's resolved path, size and mtime: a replaced file gets a fresh folder.
    """
    gguf = Path(gguf_path).resolve()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = (cache_root or default_cache_root()) / f"{gguf.stem}-{key}"
    if (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write beside, then rename: a concurrent or interrupted start never sees half a folder.
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}.{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(str(tmp))
    (tmp / "actorlm_source.json").write_text(
        json.dumps({"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    )
    try:
        tmp.rename(out)
    except OSError:  # another process finished first; theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer_config.json").is_file():
            raise
    return out


def load_tokenizer(model_path: str, cache_root: Path | None = None) -> TextTokenizer:
    """The tokenizer of an HF folder, or of a ``.gguf`` file (converted once, then cached)."""
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        folder = gguf_tokenizer_dir(path, cache_root)
    elif path.is_dir():
        folder = path
    else:
        raise FileNotFoundError(f"no model folder or .gguf file at {model_path!r}")
    try:
        hf = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {model_path!r}: {e}") from e
    eos = _config_eos_ids(folder)
    if folder != path:  # converted from a GGUF: its stop ids are in the file's metadata
        eos |= _gguf_stop_ids(path, hf)
    return TextTokenizer(hf, eos_token_ids=eos, source=str(model_path))
