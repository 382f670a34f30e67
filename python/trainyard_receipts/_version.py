"""The package version (read by setuptools without importing the package)."""

__version__ = "0.1.0"
