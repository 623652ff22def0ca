"""The transport-agnostic service: push, pull, versions and replicas; `service.Service` wires them."""
