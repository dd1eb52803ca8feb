"""make gpu-check's probe of torch's SDPA backends (gspo_ray/bench/gpu_check.py), run here on the CPU: it must name
the backends that run attention by segment and leave out those that refuse it (CUDA-only ones, on a CPU)."""
from gspo_ray.bench.gpu_check import check_sdpa_backends


def test_sdpa_backend_probe_on_cpu():
    accepted = check_sdpa_backends("cpu")
    assert set(accepted) == {"bfloat16", "float32"}
    for ok in accepted.values():
        assert "math" in ok  # the reference backend takes every input
        assert "efficient" not in ok and "cudnn" not in ok  # CUDA kernels: refused on a CPU tensor
