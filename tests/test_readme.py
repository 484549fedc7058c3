"""The README's Python example runs as written, and its claims hold (#2)."""
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_its_comments_hold():
    (code,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    assert scope["flat"].shape == (4160,)
    assert scope["model2"]["dec"] is scope["model2"]["enc"]["w"]
    g = scope["g"]
    assert np.all(g[: 64 * 64] == 2.0) and np.all(g[64 * 64 :] == 0.0)
    assert scope["norm"].shape == () and scope["norm"].dtype == np.float64
