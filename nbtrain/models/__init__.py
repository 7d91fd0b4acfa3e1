"""Models: nbtrain's GPT and Llama, and the registry that builds any model by name
(`register_model`; see registry.py for the protocol a model package provides)."""

from .gpt import GPT, GPTConfig
from .registry import get_model, register_model, registered

__all__ = ["GPT", "GPTConfig", "register_model", "get_model", "registered"]
