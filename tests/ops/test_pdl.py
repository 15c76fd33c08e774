"""PDL launch switch: never on the CPU / interpreter, keyword arguments only when on."""

import torch

from infercore.ops import pdl


def test_pdl_off_on_cpu_and_for_large_launches(monkeypatch):
    assert not pdl.pdl_enabled(torch.zeros(1, 8))
    assert pdl.pdl_launch(False) == {}
    assert pdl.pdl_launch(True) == {"USE_PDL": True, "launch_pdl": True}
    # A CUDA-looking tensor is still refused past PDL_MAX_ROWS or with INFERCORE_PDL=0.
    class FakeCuda:
        is_cuda = True

        def __init__(self, rows):
            self.shape = (rows, 8)

        def dim(self):
            return 2

    monkeypatch.setattr(pdl, "triton_interpreter", lambda: False)
    monkeypatch.setattr(pdl, "_device_ok", lambda index: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    FakeCuda.device = torch.device("cuda", 0)
    assert pdl.pdl_enabled(FakeCuda(pdl.PDL_MAX_ROWS))
    assert not pdl.pdl_enabled(FakeCuda(pdl.PDL_MAX_ROWS + 1))
    monkeypatch.setenv("INFERCORE_PDL", "0")
    assert not pdl.pdl_enabled(FakeCuda(1))
