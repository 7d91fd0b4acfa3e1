"""`run_ranks(fn, world_size, *args)`: real gloo ranks for the tests (see nbtrain.launch)."""

from nbtrain.launch import run_ranks

__all__ = ["run_ranks"]
