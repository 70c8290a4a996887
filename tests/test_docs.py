"""The documentation's examples run as written, and agree with the README.

The ```python blocks of a page run in order in one namespace, so a later block may use what an
earlier one defined. The porting page's MNIST example runs on synthetic data: ``torchvision.datasets.MNIST``
is replaced by a small random ``TensorDataset`` of 1x28x28 images (the page says so).
"""

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return PYTHON_BLOCK.findall(text)


def run_page(name: str) -> None:
    namespace = {"__name__": "docs"}
    blocks = python_blocks((DOCS / name).read_text())
    assert blocks, f"{name} has no python block"
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/{name} python block {index + 1}", "exec"), namespace)


def synthetic_mnist(root, train=True, download=False, transform=None):
    """Stands in for ``torchvision.datasets.MNIST``: random images and labels of MNIST's shapes."""
    n = 256 if train else 128
    generator = torch.Generator().manual_seed(0 if train else 1)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=generator), torch.randint(0, 10, (n,), generator=generator))


def test_getting_started_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page("getting-started.md")


def test_the_training_loop_page_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_page("training-loop.md")
    assert "True True" in capsys.readouterr().out  # the uint8 input pipeline trained and validated


def test_porting_runs_on_synthetic_data(tmp_path, monkeypatch):
    import torchvision.datasets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torchvision.datasets, "MNIST", synthetic_mnist)
    run_page("porting.md")


def test_porting_diff_is_as_counted():
    page = (DOCS / "porting.md").read_text()
    diff = re.search(r"^```diff\n(.*?)^```", page, re.S | re.M).group(1).splitlines()
    removed = sum(line.startswith("-") and not line.startswith("---") for line in diff)
    added = sum(line.startswith("+") and not line.startswith("+++") for line in diff)
    stated = re.search(r"\*\*(\d+) changed lines\*\*: (\d+) removed, (\d+) added", page)
    assert stated, "the porting page states the diff's line count"
    assert tuple(map(int, stated.groups())) == (removed + added, removed, added)
    assert removed + added <= 15
    # The port is the one the other pages describe: a StepLR stepped per epoch.
    assert 'scheduler_interval="epoch"' in "\n".join(diff)


def test_readme_quick_start_is_the_first_getting_started_example():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1]
    first = python_blocks((DOCS / "getting-started.md").read_text())[0]
    assert python_blocks(quick_start)[0] == first


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_python_blocks_compile(page):
    """Every page's python blocks at least parse; the two pages above also run."""
    for index, block in enumerate(python_blocks((DOCS / page).read_text())):
        compile(block, f"docs/{page} python block {index + 1}", "exec")
