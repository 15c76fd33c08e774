import torch

from infercore.models import ModelConfig, build_model


def tiny_hf(kind: str = "llama", **overrides):
    """A tiny random transformers model (the reference) and its config dict."""
    import transformers

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    base.update(overrides)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**base)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**base, head_dim=8)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**base, sliding_window=6)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    # Spread logits so greedy choices are far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def ours_from_hf(hf_model):
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"))
    model.load_weights(hf_model.state_dict().items())
    return model


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


class EagerGraph:
    """Stands in for a captured graph on the CPU: replays the graph's forward eagerly into the
    static output buffers, so a CUDA-graph runner's staging, padding and gather run for real."""

    def __init__(self, gr, b):
        self.gr, self.b = gr, b

    def replay(self):
        logits, tokens = self.gr._forward(self.b)
        self.gr.logits[self.b].copy_(logits)
        if tokens is not None:
            self.gr.tokens[self.b].copy_(tokens)


def with_fake_graphs(eng, cls, *, max_batch, buckets):
    """Give ``eng`` a graph runner of class ``cls`` whose graphs are :class:`EagerGraph` stand-ins."""
    from infercore.engine.graph_runner import _TOPP

    gr = cls(eng.runner, max_batch=max_batch, max_model_len=eng.max_model_len, page_size=eng.config.page_size,
             buckets=buckets)  # fmt: skip
    gr._row(gr.floats, _TOPP, gr.B).fill_(1.0)  # top_p of padded rows, as capture() does
    vocab = eng.runner.model.config.vocab_size
    for b in gr.buckets:
        gr.logits[b] = torch.zeros(b, vocab)
        gr.tokens[b] = torch.zeros(b, dtype=torch.long) if gr.graph_samples else None
        gr.graphs[b] = EagerGraph(gr, b)
    eng.graph_runner = gr
    return gr
