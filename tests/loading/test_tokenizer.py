"""Tokenizer from GGUF metadata and from HF directories, and chat-template rendering."""

from __future__ import annotations

import builtins
import json

import pytest

from infercore.loading import MissingTextDependencies, Tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12345 * 678?"},
    {"role": "assistant", "content": "8369910."},
    {"role": "user", "content": "Thanks — merci, 谢谢 🤗"},
]

TEXTS = [
    "Hello world",
    "12345",
    "In 2024, 3.14159 and 1,000,000 items cost $12.50!",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "héllo wörld — naïve café 日本語 🤗 Ωμέγα",
    "   leading and   multiple    spaces\t\ttabs\r\nCRLF\n",
    "don't I'll we've THEY'RE",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<repo_name>x/y<file_sep>",
    "",
    "x" * 200,
]


@pytest.fixture(scope="module")
def gguf_tok(smollm):
    return Tokenizer.from_gguf(smollm)


def test_encode_matches_transformers(gguf_tok, hf_gguf_tokenizer):
    chat = gguf_tok.apply_chat_template(MESSAGES)
    for text in [*TEXTS, chat]:
        assert gguf_tok.encode(text) == hf_gguf_tokenizer.encode(text), repr(text)
        assert gguf_tok.encode(text, add_special_tokens=False) == hf_gguf_tokenizer.encode(
            text, add_special_tokens=False
        ), repr(text)


def test_decode_roundtrip(gguf_tok, hf_gguf_tokenizer):
    for text in TEXTS:
        ids = gguf_tok.encode(text)
        assert gguf_tok.decode(ids, skip_special_tokens=False) == text
        assert gguf_tok.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)
    assert gguf_tok.decode(gguf_tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_special_tokens_and_ids(gguf_tok):
    assert gguf_tok.encode("<|im_start|>") == [1]
    assert gguf_tok.encode("<|im_end|>") == [2]
    assert gguf_tok.bos_token_id == 1 and gguf_tok.eos_token_id == 2
    assert gguf_tok.eos_token_ids == {2}
    assert gguf_tok.vocab_size == 49152
    assert gguf_tok.encode("hi")[0] != 1  # tokenizer.ggml.add_bos_token is false for SmolLM2
    # digits are split one by one (the "smollm" pre-tokenizer)
    assert [gguf_tok.id_to_token(i) for i in gguf_tok.encode("2024")] == ["2", "0", "2", "4"]


def test_chat_template_matches_transformers(gguf_tok, hf_gguf_tokenizer):
    for gen in (True, False):
        ours = gguf_tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=gen)
        ref = hf_gguf_tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=gen)
        assert ours == ref
    assert gguf_tok.apply_chat_template(MESSAGES).endswith("<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in gguf_tok.apply_chat_template(MESSAGES[1:2])


def test_chat_template_helpers(gguf_tok):
    tpl = (
        "{% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m|tojson }}{% endfor %}"
        "{{ strftime_now('%Y')|length }}{{ extra }}{{ eos_token }}"
    )
    tok = Tokenizer(gguf_tok.backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=tpl)
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], extra="!")
    assert out == '<|im_start|>{"role": "user", "content": "é"}4!<|im_end|>'
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="too many"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 3)
    # the sandbox refuses attribute access to Python internals
    evil = Tokenizer(gguf_tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(gguf_tok.backend).apply_chat_template([])
    with pytest.raises(TypeError, match="messages"):
        tok.apply_chat_template("hello")
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")


def test_hf_dir(tmp_path, gguf_tok):
    """An HF directory: tokenizer.json + tokenizer_config.json (+ generation_config.json)."""
    gguf_tok.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>", "special": True},
                "eos_token": "<|endoftext|>",
                "chat_template": [
                    {"name": "default", "template": template},
                    {"name": "tool_use", "template": "x"},
                ],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 0
    # eos, config/generation_config ids, and the template's turn-end token <|im_end|> (id 2)
    assert tok.eos_token_ids == {0, 2, 5, 7}
    for text in TEXTS:
        assert tok.encode(text) == gguf_tok.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"

    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "Jhi"


def test_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_missing_dependency(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("No module named 'tokenizers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(MissingTextDependencies, match=r"pip install 'infercore\[text\]'") as info:
        Tokenizer.from_hf_dir(tmp_path)
    assert isinstance(info.value, ImportError)


def test_gguf_without_tokenizer(tmp_path, write_gguf):
    import numpy as np

    path = write_gguf(tmp_path / "n.gguf", tensors={"w": (np.zeros((1, 32), np.float32), None)})
    with pytest.raises(ValueError, match="tokenizer"):
        Tokenizer.from_gguf(path)
    sp = write_gguf(tmp_path / "sp.gguf", kv=lambda w: w.add_string("tokenizer.ggml.model", "llama"))
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer.from_gguf(sp)
