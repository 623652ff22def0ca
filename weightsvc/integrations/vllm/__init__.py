"""vLLM, on both of its sides: `engine` (the driver's `update_vllm`), `worker` (the extension mixed
into each worker), `layout` (which part of each tensor a tensor-parallel rank holds), `checkpoint`
(a version against the checkpoint the engine started from) and `cpu` (the extension for vLLM's CPU
backend, the one module here that imports vLLM when imported). Nothing is imported here, so that
importing one side does not import the other's host."""
