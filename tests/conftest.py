import os

from hypothesis import HealthCheck, settings


def _cuda() -> bool:
    try:
        import torch
    except Exception:
        return False
    return torch.cuda.is_available()


# triton.jit reads TRITON_INTERPRET when a function is decorated, including triton's own library
# functions at `import triton`. Any test module may import triton indirectly (hqq does, through
# transformers' quantized caches) before tests/kernels/conftest.py runs, so it is decided here, in
# the first conftest pytest imports. Without CUDA the kernel tests run in the CPU interpreter; an
# explicit TRITON_INTERPRET in the environment is respected.
HAS_CUDA = _cuda()
if "TRITON_INTERPRET" not in os.environ and not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

# Keep hypothesis quick and deterministic on 2-core CI machines.
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
