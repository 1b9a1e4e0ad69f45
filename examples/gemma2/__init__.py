"""Gemma2 training example on cp_softcap.CPAttention (see README, "Quickstart").

Modules: config (model shapes), model (Gemma2 on CPAttention, HF weight loading), data (byte
tokenizer, batches), parallel (process groups, the CP recipe), checkpoint (DCP step-N folders),
train (the torchrun entry point).
"""
