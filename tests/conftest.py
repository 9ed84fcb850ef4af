import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import References  # noqa: E402  (tests/ on the path first)


@pytest.fixture(autouse=True)
def every_drill_fired(request):
    """A fault drill that never fired tested nothing: the test fails on it (its rank's
    ``drill_unfired`` event), unless it is marked ``drill_may_not_fire``."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None or request.node.get_closest_marker("drill_may_not_fire"):
        return
    never = sorted({line for path in Path(tmp).rglob("rank_*.jsonl") for line in path.read_text().splitlines()
                    if '"drill_unfired"' in line})
    if never:
        pytest.fail("fault drill(s) never fired:\n" + "\n".join(never), pytrace=False)


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Fault-free runs shared by every test of the session (helpers.References)."""
    return References(tmp_path_factory)
