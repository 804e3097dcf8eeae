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


# Tests whose outcome depends on the installed transformers (how caches, attention calls and the
# continuous-batching internals look): CI runs them under the newest release and again under the
# supported floor (scripts/test.sh, `-m transformers_range` with the floor side-installed), and their
# ids carry the release they ran under, so a failure says which one.
VERSION_SENSITIVE = (
    "tests/recorder/", "tests/serving_detectors/", "tests/geometry/test_geometry_sweep.py",
    "tests/geometry/test_geometry_measured.py", "tests/geometry/test_hybrid_geometry.py", "tests/accuracy/test_accuracy.py",
    "tests/whatif/test_rerun.py",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version_sensitive(path: str) -> bool:
    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
    return rel.startswith(VERSION_SENSITIVE)


def _transformers_release() -> str | None:
    try:
        import transformers
    except Exception:  # noqa: BLE001 - the analyser-only environment has none
        return None
    return transformers.__version__


def pytest_configure(config):
    config.addinivalue_line("markers", "transformers_range: runs under every supported transformers release")


def pytest_generate_tests(metafunc):
    if not _version_sensitive(str(metafunc.definition.path)):
        return
    release = _transformers_release()
    if release is None:
        return
    metafunc.fixturenames.append("transformers_release")
    metafunc.parametrize("transformers_release", [release], ids=[f"transformers-{release}"])


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if _version_sensitive(str(item.path)):
            item.add_marker(pytest.mark.transformers_range)
