"""Reference models used by the demo, tutorials, tests and benchmarks."""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
