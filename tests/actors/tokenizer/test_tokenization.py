"""Loading, encoding and chat templates on SmolLM2's real tokenizer."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from actorlm.actors.tokenizer.tokenization import ChatTemplateError, TextTokenizer, load_tokenizer
from actorlm.messages.generate import ChatMessage

MIXED = "Héllo wörld! 🙂👍🏽 日本語のテキスト 中文  \n\n\t  tabs   ñandú Ελληνικά العربية"


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> TextTokenizer:
    return load_tokenizer(str(tokenizer_dir))


def test_basic_properties(tok: TextTokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == {2}  # <|im_end|>
    assert tok.is_special(1) and tok.is_special(2) and not tok.is_special(19556)
    assert tok.convert_ids_to_tokens([19556, 2]) == ["Hello", "<|im_end|>"]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok: TextTokenizer, add_special_tokens: bool) -> None:
    for text in [MIXED, "", "<|im_start|>user\nhi<|im_end|>", "a" * 3000]:
        assert tok.encode(text, add_special_tokens) == tok.hf.encode(
            text, add_special_tokens=add_special_tokens
        )
    assert tok.decode(tok.encode(MIXED)) == MIXED


def test_encode_is_thread_safe(tok: TextTokenizer) -> None:
    texts = [f"{MIXED} request {i} " * (1 + i % 7) for i in range(64)]
    serial = [tok.encode(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(tok.encode, texts)) == serial


def test_chat_template_renders_smollm2_format(tok: TextTokenizer) -> None:
    chat = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    text = tok.render_chat(chat)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(chat)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    closed = tok.render_chat(chat, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>user\nHi<|im_end|>\n")
    # The template adds its default system prompt when the chat has none.
    assert "You are a helpful AI assistant" in tok.render_chat([chat[1]])


def test_chat_content_parts(tok: TextTokenizer) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    text = tok.render_chat([ChatMessage(role="user", content=parts)])
    assert "<|im_start|>user\nHello there<|im_end|>" in text
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.render_chat([ChatMessage(role="user", content=image)])


def test_no_template_and_generation_config_eos(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_tokenizer(str(folder))
    assert tok.eos_token_ids == {0, 2}
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([ChatMessage(role="user", content="Hi")])


def test_token_text_and_bytes(tok: TextTokenizer) -> None:
    ids = tok.encode(MIXED)
    assert b"".join(tok.token_bytes(i) for i in ids) == MIXED.encode()
    assert tok.token_texts(ids[:3]) == ["H", "é", "llo"]
    assert tok.token_text(2) == "<|im_end|>"
    emoji_bytes = tok.hf.convert_tokens_to_ids(["ð", "Ł", "Ļ", "Ĥ"])  # 🙂 one byte per token
    assert tok.token_text(emoji_bytes[0]) == "\ufffd"
    assert b"".join(tok.token_bytes(i) for i in emoji_bytes) == "🙂".encode()


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer("/nonexistent/model")


def test_gguf_tokenizer_is_cached(default_gguf: Path, tmp_path: Path, tok: TextTokenizer) -> None:
    t0 = time.perf_counter()
    first = load_tokenizer(str(default_gguf), cache_root=tmp_path)
    convert_s = time.perf_counter() - t0
    (cached,) = tmp_path.iterdir()
    assert (cached / "tokenizer.json").is_file()
    t0 = time.perf_counter()
    second = load_tokenizer(str(default_gguf), cache_root=tmp_path)
    cached_s = time.perf_counter() - t0
    assert list(tmp_path.iterdir()) == [cached]
    assert cached_s < convert_s / 2, (cached_s, convert_s)
    for t in (first, second):
        assert t.encode(MIXED) == tok.encode(MIXED)
        assert t.eos_token_ids == {2}
        assert t.render_chat([ChatMessage(role="user", content="Hi")]) == tok.render_chat(
            [ChatMessage(role="user", content="Hi")]
        )
