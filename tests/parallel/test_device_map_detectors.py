"""Detectors judge each device of a model spread over GPUs (device_map) against its own memory and
name the device that limits. Synthetic two-GPU traces (tests/parallel/two_gpu_trace.py)."""

from __future__ import annotations

from kvtrace.analyzer import analyze
from tests.parallel.two_gpu_trace import GiB, MiB, Plan, write


def _by(report, detector):
    return [f for f in report.findings if f.detector == detector]


def test_capacity_names_the_smaller_fuller_gpu(tmp_path):
    rep = analyze(write(tmp_path / "t.kvt.h5", Plan(total={0: 80 * GiB, 1: 24 * GiB},
                                                    resident={0: 10 * GiB, 1: 20 * GiB})))
    (f,) = _by(rep, "capacity")
    assert f.device == 1 and f.layers == [2, 3]
    assert f.evidence["devices_judged"].value == 2
    assert f.evidence["device_memory_bytes"].value == 24 * GiB
    # cuda:1 has 24 - 20.4 GiB (resident = reserved at baseline) for 2 of the 4 layers' KV
    per_seq = f.evidence["kv_per_sequence_bytes"].value
    assert f.evidence["max_concurrent_sequences"].value == int((24 * GiB - (20 * GiB + 464 * MiB)) // per_seq)
    assert f.score > 0.3 and "cuda:1" in f.message and "limits" in f.message


def test_capacity_balanced_gpus_judged_each(tmp_path):
    rep = analyze(write(tmp_path / "t.kvt.h5", Plan()))
    (f,) = _by(rep, "capacity")
    assert f.evidence["devices_judged"].value == 2 and f.score == 0.0


def test_post_eos_attributes_retention_to_its_device(tmp_path):
    rep = analyze(write(tmp_path / "t.kvt.h5", Plan(retained={0: 0, 1: 256 * 1024}, alive_layers=[2, 3])))
    (f,) = _by(rep, "post_eos")
    assert f.kind == "retained_after_request" and f.device == 1 and f.layers == [2, 3]
    assert "cuda:0 0 B, cuda:1 256.0 KiB" in f.message


def test_fragmentation_per_device(tmp_path):
    rep = analyze(write(tmp_path / "t.kvt.h5", Plan(total={0: 80 * GiB, 1: 24 * GiB},
                                                    resident={0: 2 * GiB, 1: 2 * GiB}, split={0: 0, 1: 400 * MiB})))
    frag = {f.device: f for f in _by(rep, "fragmentation")}
    assert set(frag) == {0, 1}
    assert frag[1].kind == "split_fragmentation" and frag[1].score > 0.3 and frag[1].message.startswith("cuda:1")
    assert frag[0].score == 0.0
    assert frag[1].evidence["limit_bytes"].value == 24 * GiB  # judged against its own memory


def test_oom_on_the_second_gpu_is_named(tmp_path):
    text = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
            "24.00 GiB of which 10.00 MiB is free.")
    rep = analyze(write(tmp_path / "t.kvt.h5", Plan(total={0: 80 * GiB, 1: 24 * GiB}, oom_text=text,
                                                    resident={0: 30 * GiB, 1: 10 * GiB})))
    (f,) = _by(rep, "oom")
    assert 10 * GiB <= f.evidence["allocated_bytes"].value < 11 * GiB  # cuda:1's state at the OOM
    assert f.device == 1  # the recorder wrote the event on cuda:0; torch's message names cuda:1
    assert "on cuda:1" in f.message
    assert f.evidence["device_memory_bytes"].value == 24 * GiB


def test_capacity_gpu_plus_cpu_offload_counts_only_the_gpu_layers(tmp_path):
    """Layers 2-3 run on the CPU (device_map 'cpu' executed there): their KV is reported apart."""
    rep = analyze(write(tmp_path / "t.kvt.h5", Plan(layer_device={0: 0, 1: 0, 2: -1, 3: -1})))
    (f,) = _by(rep, "capacity")
    assert f.device == 0 and f.layers == [0, 1] and f.evidence["devices_judged"].value == 1
    gpu_kv, cpu_kv = f.evidence["kv_per_sequence_bytes"].value, f.evidence["kv_on_cpu_bytes"].value
    assert gpu_kv == cpu_kv > 0  # two layers each side
    assert f.message.startswith("On cuda:0") and "on the CPU (offloaded layers)" in f.message
