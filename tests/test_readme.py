"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write checkpoints
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})


def test_readme_test_command_is_what_ci_runs():
    ci = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert "grep -m1 '^pip install .*python -m pytest' README.md" in ci
    # The one command installs what the tests need, then runs them, so it works on a fresh machine.
    assert re.search(r'^pip install -e "\.\[test\]" && python -m pytest', README.read_text(), re.M)
