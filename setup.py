"""Build script: the package is pure Python plus (see csrc/) an optional C extension."""

from setuptools import setup

setup()
