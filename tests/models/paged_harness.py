"""Test harness: drive an infercore model over hand-built paged KV, and tiny HF reference models.

The KV pages of every sequence are drawn from a shuffled pool, so a model that assumed contiguous
pages (or mixed up sequences) would read the wrong keys. Unused cache memory is filled with large
random values rather than zeros, so reading an unwritten slot changes the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from infercore.models import load_model
from infercore.ops import AttentionMetadata


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the cache
    pages: list[int] = field(default_factory=list)


class PagedRunner:
    """Owns per-layer KV caches and hands out pages; ``step`` runs one ragged forward."""

    def __init__(self, model, *, num_pages: int = 64, page_size: int = 4, seed: int = 0) -> None:
        self.model = model
        self.page_size = page_size
        gen = torch.Generator().manual_seed(seed)
        device = next(model.parameters()).device
        self.kv_caches = []
        for spec in model.kv_specs():
            shape = (num_pages, page_size, spec.num_kv_heads, spec.head_dim)
            k = (torch.randn(shape, generator=gen) * 100).to(device=device, dtype=spec.dtype)
            v = (torch.randn(shape, generator=gen) * 100).to(device=device, dtype=spec.dtype)
            self.kv_caches.append((k, v))
        self.free_pages = list(range(num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.seqs: dict[int, _Seq] = {}

    def step(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Feed ``new_tokens`` to each ``(seq_id, new_tokens)``; returns fp32 logits ``[T, V]``
        for every fed token, in batch order."""
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq_id, new in batch:
            seq = self.seqs.setdefault(seq_id, _Seq())
            start, end = len(seq.tokens), len(seq.tokens) + len(new)
            while len(seq.pages) * self.page_size < end:
                seq.pages.append(self.free_pages.pop())
            for pos in range(start, end):
                slots.append(seq.pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            input_ids += new
            positions += range(start, end)
            query_lens.append(len(new))
            seq_lens.append(end)
            tables.append(list(seq.pages))
            seq.tokens += new
        device = self.kv_caches[0][0].device
        meta = AttentionMetadata.from_lists(
            query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, slot_mapping=slots, device=device
        )
        ids = torch.tensor(input_ids, dtype=torch.int32, device=device)
        pos = torch.tensor(positions, dtype=torch.int32, device=device)
        with torch.inference_mode():
            hidden = self.model(ids, pos, self.kv_caches, meta)
            return self.model.compute_logits(hidden)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Batched prefill of all prompts, then one batched decode step per new token."""
        logits = self.step(list(enumerate(prompts)))
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        nxt = logits[ends].argmax(-1).tolist()
        out = [[t] for t in nxt]
        for _ in range(max_new_tokens - 1):
            logits = self.step([(i, [t]) for i, t in enumerate(nxt)])
            nxt = logits.argmax(-1).tolist()
            for o, t in zip(out, nxt):
                o.append(t)
        return out


# ---------------------------------------------------------------------------------- HF references
def tiny_hf_config(kind: str, **overrides):
    """A tiny transformers config of family ``kind`` (hidden 64, vocab 300, 2-3 layers)."""
    import transformers as tf

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    if kind == "llama":
        cfg = tf.LlamaConfig(**{**common, **overrides})
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**{**common, "rope_theta": 1e6, **overrides})
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**{**common, "head_dim": 32, **overrides})  # head_dim*heads != hidden
    elif kind == "mistral":
        cfg = tf.MistralConfig(**{**common, "sliding_window": 8, **overrides})
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_hf_model(kind: str, *, seed: int = 0, **overrides):
    import transformers as tf

    cfg = tiny_hf_config(kind, **overrides)
    cls = {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "mistral": tf.MistralForCausalLM,
    }[kind]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        # HF zero-initialises biases and sets norms to 1; randomise them so they are really tested.
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_from_hf(hf_model, tmp_path, *, dtype=torch.float32):
    """Our model with the HF model's weights, through ``save_pretrained`` (safetensors) and
    :func:`infercore.models.load_model` — the path a user takes."""
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, _, config = load_model(tmp_path, dtype=dtype, device="cpu")
    return model, config


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(hf_model, tokens: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([tokens]),
            attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(tokens) :].tolist()
