import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import References  # noqa: E402  (tests/ on the path first)


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Fault-free runs shared by every test of the session (helpers.References)."""
    return References(tmp_path_factory)
