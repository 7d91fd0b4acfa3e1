"""Layers and losses under BMTrain's `bmt.nn` / `bmt.loss` names."""
