"""Sharded replicas: the registry and each replica's part of a version."""
