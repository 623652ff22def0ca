"""Loading served copies into running inference engines, one module per host: `torch` (any torch
module, HF transformers included), `sglang`, and `vllm` (the driver's `update_vllm`, the workers'
extension, their tensor-parallel layout and the checks against the engine's checkpoint).

Each imports its host lazily, or not at all (the engines are duck-typed): weightsvc runs where no
engine is installed. `weightsvc.loaders` is their public face."""
