"""Bad configs, devices and CLI flags give a ValueError/TypeError (or an argparse error) naming them."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from infercore import cli
from infercore.models import ModelConfig, build_model, config_from_hf, load_model

BASE = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 16,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_attention_heads": 0}, "'num_attention_heads' must be a positive int, got 0"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be a positive int, got 0"),
        ({"hidden_size": "16"}, "'hidden_size' must be a positive int, got '16'"),
        ({"hidden_size": 16.0}, "'hidden_size' must be a positive int, got 16.0"),
        ({"rms_norm_eps": "abc"}, "'rms_norm_eps' must be a positive number"),
        ({"rope_theta": "x"}, "'rope_theta' must be a number"),
        ({"rope_scaling": "linear"}, "'rope_scaling' must be an object"),
        ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
        ({"eos_token_id": "x"}, "'eos_token_id' must be a token id"),
        ({"architectures": ["LlamaForTokenClassification"]}, "architectures=.*LlamaForTokenClassification"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures=.*Qwen3ForSequenceClassification"),
        ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "2": "b"}}, "'id2label'"),
        ({"architectures": ["LlamaForSequenceClassification"], "id2label": None, "num_labels": 0}, "'num_labels'"),
        ({"architectures": "LlamaForCausalLM"}, "architectures='LlamaForCausalLM' is not supported"),
    ],
)
def test_from_hf_names_the_bad_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**BASE, **overrides})


def test_from_hf_qwen2_window_layers_type():
    hf = {**BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
          "sliding_window": 4, "max_window_layers": "1"}
    with pytest.raises(ValueError, match="'max_window_layers' must be an int"):
        ModelConfig.from_hf(hf)


def test_config_from_hf_needs_a_mapping():
    with pytest.raises(TypeError, match="config: expected an HF config.json dict, got list"):
        config_from_hf([BASE])


def test_load_model_refuses_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["LlamaForTokenClassification"]}))
    save_file({"embed_tokens.weight": torch.zeros(16, 16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="architectures=\\['LlamaForTokenClassification'\\]"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")
    # a bare decoder (embedding models) loads, but not without its weights
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["LlamaModel"]}))
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


# ----------------------------------------------------------------------------------- devices
def test_bad_device():
    cfg = ModelConfig.from_hf(BASE)
    with pytest.raises(ValueError, match="device='bogus' is not a device name"):
        build_model(cfg, dtype=torch.float32, device="bogus")
    with pytest.raises(TypeError, match="device must be a torch.device or str"):
        build_model(cfg, dtype=torch.float32, device=1.5)
    with pytest.raises(ValueError, match="device='bogus'"):
        load_model("/nonexistent", dtype=torch.float32, device="bogus")  # before the path is read
    with pytest.raises(ValueError, match="'meta' holds no data"):
        load_model("/nonexistent", dtype=torch.float32, device="meta")


def test_unavailable_cuda_is_a_value_error():
    # No machine has a 100th GPU: without CUDA it is not available, with it the index is out of range.
    with pytest.raises(ValueError, match="device='cuda:99': (CUDA is not available|index out of range)"):
        build_model(ModelConfig.from_hf(BASE), dtype=torch.float32, device="cuda:99")


# ----------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "hi", "--device", "bogus"], "argument --device: 'bogus' is not a usable device"),
        (["info", "--device", "bogus"], "argument --device: 'bogus' is not a usable device"),
        (["generate", "hi", "--model", ""], "argument --model: .*empty string"),
        (["generate", "hi", "--kv-cache-dtype", "bf16"], "argument --kv-cache-dtype: invalid choice: 'bf16'"),
    ],
)
def test_cli_rejects_bad_flags(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_cli_checks_sampling_flags_before_loading(capsys):
    # A missing model would be reported too; the bad flag must be reported first (no load needed).
    assert cli.main(["generate", "hi", "--max-tokens", "-1", "--model", "/nonexistent"]) == 2
    assert "max_tokens must be >= 1, got -1" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--presence-penalty", "3", "--model", "/nonexistent"]) == 2
    assert "presence_penalty must be in [-2, 2]" in capsys.readouterr().err


def test_cli_serve_checks_the_port_before_loading(capsys):
    assert cli.main(["serve", "--port", "70000", "--model", "/nonexistent"]) == 2
    assert "--port must be in [0, 65535]" in capsys.readouterr().err


def test_cli_serve_starts_the_server_on_the_loaded_engine(capsys, monkeypatch):
    from infercore import serve
    from infercore.engine import Engine

    seen = {}

    class FakeServer:
        server_address = ("127.0.0.1", 1234)

        def serve_forever(self):
            seen["served"] = True

        def server_close(self):
            seen["closed"] = True

        class loop:  # noqa: N801
            @staticmethod
            def close():
                seen["loop closed"] = True

    def fake_make_server(engine, **kw):
        seen.update(kw)
        return FakeServer()

    fake = Engine.__new__(Engine)
    fake.device, fake.dtype = "cpu", "float32"
    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda path, **kw: fake))
    monkeypatch.setattr(serve, "make_server", fake_make_server)
    assert cli.main(["serve", "--port", "0", "--served-model-name", "m", "--host", "0.0.0.0"]) == 0
    assert seen == {"host": "0.0.0.0", "port": 0, "model_name": "m", "verbose": False, "served": True,
                    "closed": True, "loop closed": True, "tool_call_parser": "hermes", "reasoning_parser": None}
    assert "serving m on http://127.0.0.1:1234/v1" in capsys.readouterr().err


def test_cli_passes_the_sampling_flags(capsys, monkeypatch):
    from infercore.engine import Engine

    seen = {}

    def stream(self, prompt, params, chat=True):
        seen["params"] = params
        return iter(())

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda path, **kw: Engine.__new__(Engine)))
    monkeypatch.setattr(Engine, "stream", stream)
    argv = ["generate", "hi", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "7", "--min-p", "0.05",
            "--repetition-penalty", "1.1", "--presence-penalty", "0.5", "--frequency-penalty", "-0.25",
            "--seed", "3", "--max-tokens", "9"]
    assert cli.main(argv) == 0
    p = seen["params"]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty, p.seed, p.max_tokens) == (0.5, 0.9, 7, 0.05, 1.1, 0.5, -0.25, 3, 9)



def test_cli_int8_activations_flag(capsys, monkeypatch):
    """--int8-activations switches the native CPU INT4 GEMVs to 8-bit activations before the load (and for the
    ranks through the environment); where the host cannot, it says so and loads nothing."""
    from infercore.engine import Engine
    from infercore.ops.moe import cpu_native

    seen = {}

    def load(path, **kw):
        seen["on"] = cpu_native.int8_activations_on()
        return Engine.__new__(Engine)

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(load))
    monkeypatch.setattr(Engine, "stream", lambda self, prompt, params, chat=True: iter(()))
    monkeypatch.setenv("INFERCORE_CPU_INT8_ACTIVATIONS", "0")  # restored (unset) after the test
    try:
        assert cli.main(["generate", "hi", "--int8-activations"]) == 0
        assert seen["on"] and os.environ["INFERCORE_CPU_INT8_ACTIVATIONS"] == "1"
    finally:
        cpu_native.set_int8_activations(False)
    monkeypatch.setattr(cpu_native, "set_int8_activations", lambda on: False)  # a host without AVX512-VNNI
    seen.clear()
    assert cli.main(["generate", "hi", "--int8-activations"]) == 2
    assert "--int8-activations needs" in capsys.readouterr().err and not seen


def test_cli_checks_quantization_before_loading(capsys, tmp_path):
    assert cli.main(["generate", "hi", "--quantization", "w4a16-g9", "--model", str(tmp_path)]) == 2
    assert "quantization: expected None, 'gguf' or a scheme" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--quantization", "gguf", "--model", str(tmp_path)]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err


def test_cli_passes_quantization_and_kv_cache_dtype_to_the_loader(capsys, monkeypatch):
    from infercore.engine import Engine

    seen = {}

    def load(path, **kw):
        seen.update(kw)
        raise ValueError("not loading here")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(load))
    assert cli.main(["generate", "hi", "--quantization", "w8a16", "--kv-cache-dtype", "int8"]) == 2
    assert seen["quantization"] == "w8a16" and seen["kv_cache_dtype"] == "int8"
    assert "not loading here" in capsys.readouterr().err


def test_cli_passes_the_speculative_flag(capsys, monkeypatch):
    from infercore.engine import Engine

    seen = {}

    def from_pretrained(path, **kw):
        seen.update(kw)
        return Engine.__new__(Engine)

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(Engine, "stream", lambda self, prompt, params, chat=True: iter(()))
    assert cli.main(["generate", "hi", "--num-speculative-tokens", "4"]) == 0
    assert seen["num_speculative_tokens"] == 4
    assert cli.main(["generate", "hi"]) == 0
    assert seen["num_speculative_tokens"] == 0
