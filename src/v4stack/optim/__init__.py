"""Optimizers: Muon (V4 update), AdamW, knapsack ownership, the sharded (ZeRO) step."""
