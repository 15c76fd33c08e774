"""Tokenizers and chat templates, from an HF directory or from GGUF metadata.

The heavy lifting is the Rust ``tokenizers`` library; chat templates render with a sandboxed
``jinja2`` environment configured like transformers' (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text). Both are optional
dependencies (``pip install 'infercore[text]'``) imported on first use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .gguf import GGUFFile

_INSTALL_HINT = "pip install 'infercore[text]'"

# Turn-ending tokens of common chat formats. One that appears in the chat template and exists in
# the vocabulary also stops generation: a model often emits it where the config names another eos.
_TURN_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
)

# GGUF token types (llama_token_type): 3 = control (special), 4 = user-defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split of Llama 3's tokenizer.json (also used for "llama-bpe" in llama.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class MissingTextDependencies(ImportError):
    """``tokenizers``/``jinja2`` are not installed."""


def _require(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError as e:
        raise MissingTextDependencies(
            f"the '{module}' package is needed for tokenization and chat templates: {_INSTALL_HINT}"
        ) from e


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    jinja2 = _require("jinja2")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON in {path}: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _token_ids(value: Any, where: str) -> list[int]:
    """An eos/bos id field: an int, a list of ints, or null."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where}: expected a token id or a list of token ids, got {value!r}")
    return ids


def _string_list(gf: GGUFFile, key: str) -> list[str]:
    value = gf.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"GGUF metadata {key!r} must be an array of strings: {gf.path}")
    return value


class Tokenizer:
    """Text <-> token ids, plus the model's chat template and stop tokens.

    Build with ``Tokenizer.from_hf_dir(path)`` or ``Tokenizer.from_gguf(gguf_file)``.
    """

    def __init__(
        self,
        backend: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self.backend = backend  # a tokenizers.Tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = self.token_to_id(bos_token) if bos_token else None
        self.eos_token_id: int | None = self.token_to_id(eos_token) if eos_token else None
        eos = set(int(i) for i in extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        for token in _TURN_END_TOKENS:
            token_id = self.token_to_id(token)
            if token_id is not None and chat_template and token in chat_template:
                eos.add(token_id)
        self.eos_token_ids: set[int] = eos

    # --- constructors -----------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``special_tokens_map.json``, and the eos ids of ``config.json``/``generation_config.json``
        when present)."""
        tokenizers = _require("tokenizers")
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ValueError(f"cannot load {tok_file}: {e}") from None
        cfg = _read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
        special = (
            _read_json(root / "special_tokens_map.json")
            if (root / "special_tokens_map.json").is_file()
            else {}
        )

        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if (root / "chat_template.jinja").is_file():
            try:
                template = (root / "chat_template.jinja").read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{root / 'chat_template.jinja'} is not UTF-8 text: {e}") from None
        if template is not None and not isinstance(template, str):
            raise ValueError(f"chat_template in {root / 'tokenizer_config.json'}: expected a string, got {template!r}")

        # Stop ids the model config and the generation config add (int or list in either).
        extra: list[int] = []
        for name in ("config.json", "generation_config.json"):
            if (root / name).is_file():
                extra += _token_ids(_read_json(root / name).get("eos_token_id"), f"eos_token_id in {root / name}")
        return cls(
            backend,
            bos_token=_token_content(cfg.get("bos_token")) or _token_content(special.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")) or _token_content(special.get("eos_token")),
            chat_template=template,
            extra_eos_token_ids=extra,
        )

    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | os.PathLike) -> Tokenizer:
        """From GGUF ``tokenizer.ggml.*`` metadata. Supports ``tokenizer.ggml.model == "gpt2"``
        (byte-level BPE) with pre-tokenizers ``smollm``, ``llama-bpe``/``llama3`` and gpt2's."""
        from .gguf import GGUFFile

        gf = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
        model = gf.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError(f"GGUF file has no tokenizer (tokenizer.ggml.model missing): {gf.path}")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE): "
                f"{gf.path}"
            )
        tokens = _string_list(gf, "tokenizer.ggml.tokens")
        if not tokens:
            # An empty vocabulary would "work" and turn every text into no tokens at all.
            raise ValueError(f"GGUF metadata 'tokenizer.ggml.tokens' is missing or empty: {gf.path}")
        types: list[int] = gf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = _string_list(gf, "tokenizer.ggml.merges")
        pre = gf.get("tokenizer.ggml.pre", "default")
        if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
            raise ValueError(
                f"tokenizer.ggml.token_type must be {len(tokens)} integers (one per token), got "
                f"{len(types) if isinstance(types, list) else types!r}: {gf.path}"
            )
        try:
            backend = _byte_level_bpe(tokens, types, merges, pre=pre)
        except MissingTextDependencies:
            raise
        except Exception as e:  # the Rust side raises a bare Exception (e.g. a merge of unknown tokens)
            raise ValueError(f"cannot build the tokenizer of {gf.path}: {e}") from None

        def token(key: str) -> str | None:
            idx = gf.get(f"tokenizer.ggml.{key}")
            if idx is not None and (not isinstance(idx, int) or isinstance(idx, bool)):
                raise ValueError(f"GGUF metadata 'tokenizer.ggml.{key}' must be a token id, got {idx!r}: {gf.path}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        bos, eos = token("bos_token_id"), token("eos_token_id")
        # llama.cpp adds BOS for llama-bpe vocabularies unless the file says otherwise.
        add_bos = bool(gf.get("tokenizer.ggml.add_bos_token", pre in ("llama-bpe", "llama3", "llama-v3")))
        add_eos = bool(gf.get("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(backend, bos if add_bos else None, eos if add_eos else None)
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=gf.get("tokenizer.chat_template"))

    # --- API ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the tokenizer is configured
        to (special tokens written in the text are always recognized)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list of ints or a 1-D integer tensor)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """Render the chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: append the assistant turn header.
            template_vars: extra template variables (``tools``, ``enable_thinking``, ...).

        The template also sees ``bos_token`` and ``eos_token``. The rendered prompt already holds
        any BOS the template writes: encode it with ``add_special_tokens=False`` to avoid a
        second one.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages: expected a list of {'role': ..., 'content': ...} dicts")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **template_vars}
        return _compile_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], *, pre: str) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` from a GGUF vocabulary (llama.cpp's "gpt2")."""
    tk = _require("tokenizers")
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    alphabet = set(_bytes_to_unicode().values())
    byte_char = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        # Ordinary tokens are stored in the byte alphabet already; a few files store raw text,
        # which is re-spelled. Control/user tokens keep their text: they are matched whole.
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(byte_char[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))

    # Llama 3 matches whole words in the vocabulary before merging (its tokenizer.json sets it).
    llama3 = pre in ("llama-bpe", "llama3", "llama-v3")
    backend = tk.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=llama3)
    )
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif llama3:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()

    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED
    ]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    return backend


def _set_post_processor(backend: Any, bos: str | None, eos: str | None) -> None:
    """Make ``encode(..., add_special_tokens=True)`` add BOS/EOS (only those given)."""
    if bos is None and eos is None:
        return
    from tokenizers import processors

    prefix = [bos] if bos else []
    suffix = [eos] if eos else []
    single = prefix + ["$A"] + suffix
    pair = prefix + ["$A"] + suffix + prefix + ["$B:1"] + suffix
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(prefix + suffix)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
