"""The documentation's examples run as written. A page's ```python blocks run in order in one namespace, so a later
block may use what an earlier one defined. The porting page's MNIST runs on synthetic data of MNIST's shapes."""

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

DOCS = Path(__file__).parent.parent / "docs"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def synthetic_mnist(root, train=True, download=False, transform=None):
    """Stands in for ``torchvision.datasets.MNIST``: random images and labels of MNIST's shapes."""
    n = 256 if train else 128
    generator = torch.Generator().manual_seed(0 if train else 1)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=generator), torch.randint(0, 10, (n,), generator=generator))


@pytest.mark.parametrize("page", ["getting-started.md", "training-loop.md", "porting.md", "diagnostics.md",
                                  "custom-policies.md"])
def test_the_pages_examples_run(page, tmp_path, monkeypatch):
    import torchvision.datasets

    monkeypatch.chdir(tmp_path)  # examples may write checkpoints
    monkeypatch.setattr(torchvision.datasets, "MNIST", synthetic_mnist)
    namespace = {"__name__": "docs"}
    blocks = PYTHON_BLOCK.findall((DOCS / page).read_text())
    assert blocks, f"{page} has no python block"
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/{page} python block {index + 1}", "exec"), namespace)


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_pages_python_blocks_parse(page):
    """The pages that need a GPU or torchao at least parse; the four above also run."""
    for index, block in enumerate(PYTHON_BLOCK.findall((DOCS / page).read_text())):
        compile(block, f"docs/{page} python block {index + 1}", "exec")
