"""Importing this registers toy_lm as "toy" (what `nbtrain validate --import` does)."""

from nbtrain.models import register_model

register_model("toy", package="toy_lm", impls={"default": "toy_lm.protocol"}, replace=True)
