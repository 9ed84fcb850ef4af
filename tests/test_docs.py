"""The documentation says what the code does: every HA flag and every variable the package reads is on
the flags page, README stays a first reader's page and names the test command CI runs. (The site
itself is built in CI in strict mode: .ci/run's sphinx-build -W.)"""
from __future__ import annotations

import argparse
import re

from helpers import REPO

from mindspeed_ha.options import add_ha_args

FLAGS_PAGE = (REPO / "docs" / "flags.md").read_text()


def test_every_ha_flag_is_on_the_flags_page():
    parser = add_ha_args(argparse.ArgumentParser(add_help=False))
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings]
    missing = [f for f in flags if f"`{f}" not in FLAGS_PAGE]
    assert flags and not missing, missing


def test_every_variable_the_package_reads_is_on_the_flags_page():
    names = set()
    for path in (REPO / "mindspeed_ha").rglob("*.py"):
        names |= set(re.findall(r'"(MINDSPEED_HA_[A-Z_]+)"', path.read_text()))
    missing = sorted(n for n in names if f"`{n}`" not in FLAGS_PAGE)
    assert len(names) > 20 and not missing, missing


def test_readme_is_a_first_readers_page_with_cis_own_commands():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert len(readme.splitlines()) < 200
    test_command = "pytest -q -n 2 --dist worksteal tests"
    install = 'pip install torch==2.13.0 && pip install -e ".[test,megatron-lm]"'
    assert test_command in readme and test_command in ci
    assert install in readme and "pip install -q torch==2.13.0" in ci and '-e ".[test,megatron-lm' in ci
    for page in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / page).exists(), page
