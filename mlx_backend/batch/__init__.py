"""Batched speculative decoding: several sequences verified in one forward, each cut back exactly."""
