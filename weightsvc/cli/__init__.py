"""The `weightsvc` command: serve, push, pull, export, status, demo, bench."""
