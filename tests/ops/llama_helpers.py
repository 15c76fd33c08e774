"""A tiny random Llama and a prefill-then-greedy-decode loop over it, for the CPU tests of kernels
that the Llama layer calls (test_linear, test_attention_triton)."""

import torch


def tiny_llama(hidden_act="silu", mlp_bias=False):
    from infercore.models import ModelConfig, build_model

    cfg = ModelConfig.from_hf(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=61, hidden_size=32,
        intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        hidden_act=hidden_act, mlp_bias=mlp_bias,
    ))  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device="cpu", init="normal")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # build_model zeroes them: make a mixed-up bias visible
    return model


def run_tiny_llama(model, prompt: list[int], extra: int) -> torch.Tensor:
    """Prefill ``prompt`` (M = len rows), then decode ``extra`` greedy tokens (M = 1); returns the
    fp32 logits of every step's rows, concatenated."""
    from infercore.ops import AttentionMetadata

    page = 4
    caches = [(torch.zeros(8, page, s.num_kv_heads, s.head_dim), torch.zeros(8, page, s.num_kv_heads, s.head_dim))
              for s in model.kv_specs()]  # fmt: skip
    table = [3, 0, 5, 1, 7]
    out, toks, start = [], list(prompt), 0
    with torch.inference_mode():
        for _ in range(extra + 1):
            new = toks[start:]
            end = len(toks)
            meta = AttentionMetadata.from_lists(
                query_lens=[len(new)], seq_lens=[end], block_tables=[table],
                slot_mapping=[table[p // page] * page + p % page for p in range(start, end)], device="cpu")  # fmt: skip
            pos = torch.arange(start, end, dtype=torch.int32)
            logits = model.compute_logits(model(torch.tensor(new, dtype=torch.int32), pos, caches, meta))
            out.append(logits)
            toks.append(int(logits[-1].argmax()))
            start = end
    return torch.cat(out)
