"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

BLOCKS = re.findall(r"```python\n(.*?)```", (Path(__file__).parent.parent / "README.md").read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write checkpoints
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})
