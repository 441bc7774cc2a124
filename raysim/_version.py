"""The version of raysim, alone in a leaf module: whoever needs it (the CLI's --version, a run's
environment record) reads it without importing the whole package."""

__version__ = "0.1.0"
