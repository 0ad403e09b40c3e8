"""The package version, declared once (pyproject.toml reads it from here): a leaf every module may import."""

__version__ = "0.1.0"
