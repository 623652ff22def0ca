"""Committed versions: the index, commit, the data dir, acks and lag."""
