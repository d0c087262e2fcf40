"""Where the math runs (aftgen.device): the device and dtype picked, and memory freed reused."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from aftgen.api import load
from aftgen.device import Placement, pick_dtype, resolve
from aftgen.errors import AftgenError

pytestmark = pytest.mark.usefixtures("one_thread")


READ_CHUNKS = """
import json, resource, sys, torch
from aftgen.bench.measure import memory_mb
from aftgen.device import reuse_freed_memory
from aftgen.model import AFTLM, AFTConfig
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
torch.manual_seed(0)
model = AFTLM(AFTConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=2, window=16, context_length=64)).eval()
ids, state, faults = torch.randint(0, 256, (1, 1024)), model.initial_state(1), []
with torch.inference_mode():
    for _ in range(12):  # 1024-token chunks, as prompts are read: megabytes of intermediates each
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _, state = model.prefill(ids, state, last_only=True)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": sum(faults[4:]), "peak": memory_mb()[1]}))
"""


@pytest.mark.cpu
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_reading_chunks_reuses_freed_memory_instead_of_faulting_in_fresh_pages():
    def read(mode: str) -> dict:
        done = subprocess.run([sys.executable, "-c", READ_CHUNKS, mode], capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    default, reuse = read("default"), read("reuse")
    if default["faults"] < 1000:
        pytest.skip(f"this allocator already reuses freed memory ({default['faults']} page faults in 8 chunks)")
    # A tenth: reusing, 8 chunks fault in 0-10 pages, now and then 130-260 (a thread's first use of its stack,
    # say); not reusing, 4,000-5,400.
    assert reuse["faults"] < default["faults"] // 10
    assert reuse["peak"] <= default["peak"] + 16  # MB: kept memory is reused, not piled up


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_missing_device_is_a_clear_error(tiny_run):
    with pytest.raises(AftgenError, match="no CUDA GPU"):
        load(tiny_run, device="cuda")
    with pytest.raises(AftgenError, match="unknown --device"):
        resolve("tpu")
    with pytest.raises(AftgenError, match="unknown --dtype"):
        resolve("cpu", "fp8")


def test_generating_on_a_cpu_bf16_stores_the_weights_lower_instead_of_autocasting(monkeypatch):
    import aftgen.device

    assert resolve("cpu", "bf16", generating=True) == Placement(torch.device("cpu"), weights=torch.bfloat16)
    assert resolve("cpu", "bf16") == Placement(torch.device("cpu"), torch.bfloat16)  # training autocasts
    assert resolve("cpu", "fp32", generating=True) == Placement(torch.device("cpu"))
    for has_bf16 in (True, False):
        monkeypatch.setattr(aftgen.device, "cpu_has_bf16", lambda has_bf16=has_bf16: has_bf16)
        auto = resolve("cpu", "auto", generating=True)
        assert auto.weights == (torch.bfloat16 if has_bf16 else torch.float32) and auto.dtype == torch.float32
    assert "bf16 weights" in resolve("cpu", "bf16", generating=True).describe()


def test_a_gpu_without_bf16_autocasts_in_fp16_and_refuses_bf16_by_name(monkeypatch):
    """Asked for nothing, an older CUDA GPU gets fp16; asked for bf16 by name, the error names the GPU and fp16."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    gpu = torch.device("cuda:0")
    assert pick_dtype("auto", gpu) == torch.float16 and pick_dtype("fp32", gpu) == torch.float32
    with pytest.raises(AftgenError, match="--dtype bf16: Tesla T4 has no bf16; use --dtype fp16"):
        pick_dtype("bf16", gpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert pick_dtype("auto", gpu) == pick_dtype("bf16", gpu) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32  # CPU autocast is often slower


def test_fp32_autocasts_nothing_and_a_mixed_placement_autocasts_its_matmuls():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with Placement(torch.device("cpu")).autocast():
        assert (a @ b).dtype == torch.float32
    mixed = Placement(torch.device("cpu"), torch.bfloat16)
    with mixed.autocast():
        assert (a @ b).dtype == torch.bfloat16
    assert mixed.mixed and mixed.describe() == "cpu bf16" and not Placement(torch.device("cpu")).mixed
