"""The transport-agnostic core: the push lifecycle, committed versions, the registry, lag and deltas."""
