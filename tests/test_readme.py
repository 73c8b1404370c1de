"""The README's Python blocks run, in order, as a reader would run them (one namespace, top to bottom)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The fenced ``python`` blocks of a Markdown text, in order."""
    return BLOCK.findall(text)


def test_the_block_finder_finds_python_blocks_only():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = x\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = x\n"]


# the first tier's time (issue 41): 15 of its 20 s are block 5's qwen2.5-7b profile, the one
# tests/test_cli_profile.py's test_default_run_answers_a_7b_fsdp2_node runs and checks in the first tier
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_every_python_block_of_the_readme_runs():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 6
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as exc:  # name the block, then fail with its own error
            raise AssertionError(f"README python block {i + 1} raised {type(exc).__name__}: {exc}") from exc
