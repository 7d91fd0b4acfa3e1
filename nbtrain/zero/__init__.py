"""ZeRO sharding: partition maths, DistributedParameter, Block, TransformerBlockList, wrap."""
from .block import Block, ZeroLevel
from .meta import assign_inits, empty_parameters, normal_inits, torch_default_inits
from .blocklist import TransformerBlockList
from .module import DistributedModule
from .parameter import DistributedParameter, ParameterInitializer
from .root import ModelRoot
from .wrap import wrap
from .views import full_named_grads, init_parameters

__all__ = ["Block", "ZeroLevel", "TransformerBlockList", "DistributedModule",
           "DistributedParameter", "ParameterInitializer", "init_parameters", "wrap",
           "full_named_grads", "ModelRoot", "empty_parameters", "assign_inits", "normal_inits",
           "torch_default_inits"]
