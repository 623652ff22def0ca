"""Thin adapters from gRPC and HTTP to the core: requests in, domain errors out."""
