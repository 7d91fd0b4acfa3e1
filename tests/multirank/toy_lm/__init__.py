"""A model package that lives only in the test folder: a token-mixing MLP language model
(no attention), registered with `nbtrain.models.register_model` and trained through
`nbtrain.runtime` with nothing else in nbtrain knowing it.

The package gives the configuration and the checkpoint mapping; `toy_lm.protocol` is
its implementation (build, load, forward step, tensor-parallel plan, pipeline layers).
"""

from dataclasses import dataclass

from nbtrain.models.hf_load import HFWeight


@dataclass
class ToyConfig:
    vocab_size: int = 48
    width: int = 32
    layers: int = 3
    tie: bool = True


def make_config(model_config: dict, hf_config: dict | None = None) -> ToyConfig:
    fields = {k: v for k, v in (hf_config or {}).items() if k in ToyConfig.__dataclass_fields__}
    return ToyConfig(**{**fields, **model_config})


def hf_names(config=None):
    """Files saved by this package name tensors as the model does."""
    return lambda name: [HFWeight(name)]
