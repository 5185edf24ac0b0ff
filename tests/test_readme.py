"""The README's Python API example runs as written (on random:tiny, in a scratch copy of
the repository's config layout), so the first thing a newcomer copies keeps working."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.models import home_sharing

ROOT = Path(__file__).resolve().parents[1]


def readme_python_example(index: int = 0) -> str:
    """The `index`-th ```python block after the README's "## Python API" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) > index, f"README.md: no ```python block #{index + 1} under '## Python API'"
    return blocks[index]


def test_readme_python_example_runs_and_streams_each_token_once(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "default.yaml", tmp_path / "configs" / "default.yaml")
    monkeypatch.chdir(tmp_path)  # the example's relative config path; its caches land under tmp_path
    monkeypatch.setenv("KVBLEND_MODEL", "random:tiny")
    monkeypatch.setenv("KVBLEND_DEVICE", "cpu")
    namespace: dict = {}
    exec(compile(readme_python_example(), "README.md", "exec"), namespace)
    streamed = capsys.readouterr().out
    final = namespace["item"]  # the stream's last item: the GenerationResult
    assert namespace["engine"].lm.random_weights
    assert final.token_ids, "the streamed generation produced no tokens"
    assert streamed == final.text  # each delta printed once, the result not printed again
    assert namespace["result"].stats.mode == "blend"
    assert (tmp_path / ".kvblend-cache").is_dir()  # the config's relative paths resolved beside it
    assert [r.stats.mode for r in namespace["results"]] == ["blend", "blend"]  # generate_many
    # the asyncio example, with the first one's documents (its default config: $KVBLEND_HOME)
    monkeypatch.setenv("KVBLEND_HOME", str(home_sharing(tmp_path / "home", "models", "kernels")))  # (built once)
    exec(compile(readme_python_example(1), "README.md", "exec"), namespace)
    assert len(namespace["answers"]) == 2 and all(a.token_ids for a in namespace["answers"])
