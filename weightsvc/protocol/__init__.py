"""What the client and the server share: the manifest and its parts, model and version names, digests,
lag metrics, the safetensors framing, selection, delta, topology, client status, gRPC names and wire
framing."""
