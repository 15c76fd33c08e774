import pytest
from engine_helpers import ours_from_hf, tiny_hf


@pytest.fixture(scope="module")
def llama_pair():
    hf = tiny_hf("llama")
    return hf, ours_from_hf(hf)
