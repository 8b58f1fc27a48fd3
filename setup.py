"""Builds jax_overlap: the Python package and, where present, the C++ runtime parts."""

from setuptools import setup

setup()
