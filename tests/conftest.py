"""Test setup: offline Hub and datasets, a session-wide datasets cache, tiny-model fixtures. Plain helpers the tests
import live in helpers.py."""

import os

# Before anything imports huggingface_hub / datasets: no network, ever (a wrong Hub id would otherwise retry ~25 s).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two test processes at once (`pytest -n 2`, as `make test` runs): one thread each, and one for every process
    # they start, or their thread pools spin against each other on two cores (every op up to 20x slower).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # The fused S4D kernels (Triton, s4accel/models/s4d_fused.py) then run in Triton's interpreter on CPU tensors:
    # set before anything imports the models, since `triton.jit` reads it when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import collections  # noqa: E402

import pytest  # noqa: E402

from helpers import small_text_file  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, each file's tests kept together and in order: under `-n 2 --dist
    loadfile` a long file handed out last leaves one worker running it alone at the end."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="session", autouse=True)
def hf_cache(tmp_path_factory):
    """One datasets cache for the whole session: the plays are tokenised once, every later run reads the cache. Set
    before any test runs, so that the CLI's fork server (helpers.py), which imports datasets with the environment
    it starts with, serves every command that keeps it."""
    path = tmp_path_factory.mktemp("hf_datasets_cache")
    os.environ["HF_DATASETS_CACHE"] = str(path)
    return path


@pytest.fixture
def tiny_config():
    from s4accel import S4Config

    return S4Config(d_model=32, n_layer=2, d_state=8, vocab_size=50)


@pytest.fixture(scope="module")
def text(tmp_path_factory, hf_cache):
    """A small text file (a few plays' worth), once per test module."""
    return small_text_file(tmp_path_factory.mktemp("text"))
