"""`nbtrain.wrapper`: BMTrain's module of the same name: `BMTrainModelWrapper`
(nbtrain.zero.bmtrain_wrapper), which makes a plain model distributed. BMTrain's
helpers `make_distributed` and `model_wrapper_dispatch` are the steps of that wrapper
(nbtrain's is `nbtrain.wrap`)."""

from . import BMTrainModelWrapper

__all__ = ["BMTrainModelWrapper"]
