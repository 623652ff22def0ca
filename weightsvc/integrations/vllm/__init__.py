"""vLLM, on both of its sides: `engine` (the driver's `update_vllm`), `worker` (the extension mixed
into each worker, and what a rank pulls), `layout` (which part of each tensor a tensor-parallel rank
holds), `checkpoint` (a version against the checkpoint the engine started from) and `cpu` (the
extension for vLLM's CPU backend). For `vllm serve`: `transfer` (weightsvc as a weight-transfer
backend of vLLM's RL API, registered by `plugin`, the `vllm.general_plugins` entry point), and
`follower` with `engine_api` (the loop of `weightsvc follow` and the engine routes it drives), and
`adapters` (its loop for an adapter model's revisions). `revisions`: an adapter model's revisions in
vLLM (their directories, and `LlmAdapters` for an in-process `LLM`).
`cpu` and `transfer` import vLLM when imported; vLLM imports them in its own processes. Nothing is
imported here, so that importing one side does not import the other's host."""
