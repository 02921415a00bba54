"""v4stack: the DeepSeek-V4 system loop in Python."""

__version__ = "0.1.0"
