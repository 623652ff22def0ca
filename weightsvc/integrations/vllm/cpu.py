"""`VllmCpuEmulationExtension`, for vLLM's CPU backend. This module imports vLLM at import time; it
is imported only in vLLM's workers, which resolve it through `weightsvc.loaders`.

vLLM's CPU platform lists no linear kernel for MXFP8 or NVFP4, so an engine started from such a
checkpoint fails while it builds the model ("Failed to find a kernel that can implement the MXFP8
linear layer"). vLLM's own emulation kernels (dequantize, then a bf16 matmul) run on any device; they
are registered for the CPU here, at import. vLLM imports the `worker_extension_cls` in each worker
before it builds the model (`WorkerWrapperBase.init_worker`), which is why the registration lives
in the extension's module and not in a method. Registering for the CPU changes nothing on GPUs.
MXFP4 is not registered: its emulation dequantizes with amd-quark, which runs on CUDA only."""

from __future__ import annotations

from vllm.model_executor.kernels.linear import register_linear_kernel
from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
from vllm.platforms import PlatformEnum

from weightsvc.integrations.vllm.worker import VllmWorkerExtension

__all__ = ["VllmCpuEmulationExtension"]

register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")  # W4A4 configs only


class VllmCpuEmulationExtension(VllmWorkerExtension):
    """`VllmWorkerExtension` for vLLM's CPU backend, whose workers can then run MXFP8 and NVFP4 (W4A4)
    checkpoints: `LLM(..., worker_extension_cls="weightsvc.loaders.VllmCpuEmulationExtension")`."""
