"""What the client and the server share: names, the manifest, selection, delta, topology, wire framing."""
