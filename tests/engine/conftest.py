import pytest

# engine_helpers (and through it infercore's kernel modules) is imported inside the fixture, not here: a
# directory's conftest is loaded before tests/conftest.py's pytest_configure picks TRITON_INTERPRET when the
# directory is named on the command line (`pytest tests/engine`), and triton.jit reads it at import.


@pytest.fixture(scope="module")
def llama_pair():
    from engine_helpers import ours_from_hf, tiny_hf

    hf = tiny_hf("llama")
    return hf, ours_from_hf(hf)
