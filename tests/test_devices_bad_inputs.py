"""Bad INFERCORE_BACKEND overrides and device arguments: a ValueError / TypeError naming the variable
or argument, never a silently ignored typo or an error from deep inside torch."""

import re

import pytest
import torch

import infercore.ops  # noqa: F401  (registers the implementations)
from infercore import cli
from infercore.devices import capability, register, register_probe, resolve
from infercore.kv import FullAttentionSpec, allocate_kv_caches


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("refrence", "INFERCORE_BACKEND='refrence' is not an implementation of any op"),
        ("a:b:c", "INFERCORE_BACKEND entry 'a:b:c' must be op:implementation"),
        (":", "INFERCORE_BACKEND entry ':' must be op:implementation"),
        ("rms_norm:", "INFERCORE_BACKEND entry 'rms_norm:' must be op:implementation"),
        ("rms_norm:tritn", "op 'rms_norm' has no implementation 'tritn'"),
        ("reference,triton", "INFERCORE_BACKEND='reference,triton': expected one implementation name"),
        ("rms_norm:cpu,rms_norm:reference", "INFERCORE_BACKEND names op 'rms_norm' twice"),
    ],
)
def test_bad_backend_override_names_the_variable(monkeypatch, spec, match):
    monkeypatch.setenv("INFERCORE_BACKEND", spec)
    with pytest.raises(ValueError, match=match):
        resolve("rms_norm", "cpu")


@pytest.mark.parametrize(
    ("spec", "op", "expected"),
    [
        ("", "rms_norm", None),
        ("   ", "rms_norm", None),
        ("reference", "rms_norm", "reference"),
        (" rms_norm : reference ,", "rms_norm", "reference"),
        ("sample:reference", "rms_norm", None),  # another op's override leaves this one alone
        # an op not registered (yet: infercore.quant registers its ops on import) does not stop the others
        ("quant.not_imported_yet:reference,rms_norm:reference", "rms_norm", "reference"),
        ("cpu", "sample", None),  # the every-op form skips ops without that implementation
    ],
)
def test_good_backend_overrides(monkeypatch, spec, op, expected):
    monkeypatch.delenv("INFERCORE_BACKEND", raising=False)
    default = resolve(op, "cpu").name
    monkeypatch.setenv("INFERCORE_BACKEND", spec)
    assert resolve(op, "cpu").name == (expected or default)


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'no_such_op'"):
        resolve("no_such_op", "cpu")


@pytest.mark.parametrize(("device", "exc", "match"), [
    (3, TypeError, "device must be a torch.device or str"),  # torch.device(3) would mean cuda:3
    (2.5, TypeError, "device must be a torch.device or str"),
    (["cpu"], TypeError, "device must be a torch.device or str"),
    ("gpu", ValueError, "device='gpu' is not a device name"),
])  # fmt: skip
def test_capability_bad_device(device, exc, match):
    with pytest.raises(exc, match=match):
        capability(device)


def test_resolve_bad_device():
    with pytest.raises(TypeError, match="device must be a torch.device or str"):
        resolve("rms_norm", ["cpu"])


def test_capability_cuda_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (a machine without CUDA, on any machine)
    with pytest.raises(ValueError, match="device='cuda:1': CUDA is not available"):
        capability("cuda:1")


def test_capability_cpu_still_works():
    assert capability("cpu").device_type == "cpu"
    assert capability(torch.device("cpu")) is capability("cpu")


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"op": ""}, ValueError, "register: op must be a non-empty str"),
    ({"name": "a:b"}, ValueError, "register: name must be a non-empty str without ':'"),
    ({"fn": None}, TypeError, "fn must be callable"),
    ({"priority": "1"}, TypeError, "priority must be an int"),
    ({"available": True}, TypeError, "available must be callable or None"),
])  # fmt: skip
def test_register_bad_arguments(kwargs, exc, match):
    args = {"op": "x_test_op", "name": "fast", "fn": lambda: None, **kwargs}
    with pytest.raises(exc, match=match):
        register(args.pop("op"), args.pop("name"), args.pop("fn"), **args)


def test_register_probe_bad_arguments():
    with pytest.raises(TypeError, match="probe must be callable"):
        register_probe("x_test_device", None)


def test_info_works_and_reports_bad_override(monkeypatch, capsys):
    monkeypatch.delenv("INFERCORE_BACKEND", raising=False)
    assert cli.main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "rms_norm" in out
    assert re.search(r"quant\.wq_matmul\s+-> cpu ", out)  # the quantized matmuls are listed with their CPU path
    monkeypatch.setenv("INFERCORE_BACKEND", "rms_norm:nope")
    assert cli.main(["info"]) == 2
    assert "INFERCORE_BACKEND" in capsys.readouterr().err


@pytest.mark.parametrize(("device", "exc", "match"), [
    (3, TypeError, "device must be a torch.device or str"),
    ("gpu", ValueError, "device='gpu' is not a device name"),
])  # fmt: skip
def test_allocate_kv_caches_bad_device(device, exc, match):
    with pytest.raises(exc, match=match):
        allocate_kv_caches([FullAttentionSpec(2, 8)], 2, 4, dtype=torch.float32, device=device)
