from setuptools import setup

# Everything is declared in setup.cfg; this file exists for `pip install -e .` on old pips.
setup()
