import pytest
import torch
from hf_models import build, save


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """hf_model(family, fused=False) -> (transformers model, its save_pretrained folder). Built once."""
    cache = {}

    def get(family: str, fused: bool = False):
        if family not in cache:
            cache[family] = build(family)
        key = (family, fused)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"hf-{family}-{'fused' if fused else 'per-expert'}")
            cache[key] = save(cache[family], root)
        return cache[family], cache[key]

    return get


@pytest.fixture(scope="session")
def tokens32():
    return torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(1234))


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (sampler timings and sorts over 250k logits: a busy machine's second thread
    slows them), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
