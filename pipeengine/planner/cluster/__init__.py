"""Cluster planning from a laptop: layouts for thousands of GPUs priced without running on them."""

__all__: list[str] = []
