"""Where the math runs: device, mixed-precision dtype and CPU threads, for every command.

`--device auto` picks CUDA, then Apple's MPS, then the CPU. `--dtype auto` picks bf16 autocast on
GPUs that have it (fp16 on older CUDA GPUs) and fp32 elsewhere: CPU autocast is often slower than
fp32 on CPUs without bf16 matrix units. Autocast only lowers the precision of matmuls, and the AFT
mixer switches it off for its exp/sum accumulations. Generating on a CPU is the exception: there bf16
(the default where the CPU has bf16 units) stores the weights in bf16 instead (aftgen.layers), since
autocast would recast every fp32 weight at every token.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from aftgen.errors import AftgenError
from aftgen.files import KERNEL_FILE_LIMIT, read_text

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What --device and --dtype say in every command's --help, from the tables above.
DEVICE_HELP = f"{' | '.join(DEVICES)} (cuda:N: the Nth GPU). auto: CUDA, then MPS, then CPU."
DTYPE_HELP = (
    f"{' | '.join(('auto', *DTYPES))}: mixed-precision autocast. auto: bf16 on GPUs that have it, else fp32; "
    "generating on a CPU, bf16 stores the weights in bf16 (auto: where the CPU has bf16 units)."
)


@dataclass(frozen=True)
class Placement:
    """A device, the dtype autocast computes in there (float32: no autocast), and the dtype the model's
    matrices are stored in (AFTLM.lower_weights)."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    weights: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for the forward pass (a no-op in fp32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    def describe(self) -> str:
        lowered = f" ({next(k for k, v in DTYPES.items() if v == self.weights)} weights)" if self.lowered else ""
        return f"{self.device} {self.dtype_name}{lowered}"

    @property
    def lowered(self) -> bool:
        return self.weights != torch.float32


def _mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def pick_device(name: str | torch.device = "auto", local_rank: int = 0) -> torch.device:
    """'auto' -> cuda, then mps, then cpu; 'cuda' in a multi-process run means this process's GPU."""
    if isinstance(name, torch.device):
        return name
    kind = name.split(":")[0]
    if kind not in DEVICES:
        raise AftgenError(f"unknown --device '{name}'; choose one of: {', '.join(DEVICES)}")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise AftgenError(f"--device cuda: no CUDA GPU is available to this torch ({torch.__version__})")
        return torch.device(name if ":" in name else f"cuda:{local_rank % torch.cuda.device_count()}")
    if kind == "mps" and not _mps_available():
        raise AftgenError("--device mps: Apple's MPS backend is not available here")
    return torch.device(kind)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for `name` on `device`, refusing what the device cannot do."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise AftgenError(f"unknown --dtype '{name}'; choose one of: auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise AftgenError(f"--dtype bf16: {torch.cuda.get_device_name(device)} has no bf16; use --dtype fp16")
    return dtype


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), rather than by conversion."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve(
    device: str | torch.device = "auto", dtype: str = "auto", local_rank: int = 0, generating: bool = False
) -> Placement:
    """The one place every command turns --device / --dtype into a Placement. `generating`: for a command
    that generates text, where bf16 on a CPU stores the weights in bf16 rather than autocasting."""
    where = pick_device(device, local_rank)
    if generating and where.type == "cpu" and (dtype == "bf16" or (dtype == "auto" and cpu_has_bf16())):
        return Placement(where, weights=torch.bfloat16)
    placement = Placement(where, pick_dtype(dtype, where))
    if where.type == "cuda":
        torch.cuda.set_device(where)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores; accumulation stays fp32
        torch.backends.cudnn.allow_tf32 = True
    return placement


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts that work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings counted once)."""
    if not hasattr(os, "sched_getaffinity"):  # macOS (no hyperthreads on Apple silicon), Windows
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in os.sched_getaffinity(0):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(read_text(siblings, KERNEL_FILE_LIMIT, "a CPU's topology").strip() if siblings.exists() else str(cpu))
    return max(1, len(cores))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # the most glibc accepts on 64-bit


def reuse_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of handing it back to the kernel.

    Reading a prompt allocates and frees megabytes of intermediates per chunk. glibc returns blocks
    above its mmap threshold to the kernel when they are freed (and trims its heap), so the next
    chunk touches fresh pages, each 4 KiB costing a page fault. Raised thresholds keep that memory
    in the process, as jemalloc and
    tcmalloc do (which PyTorch's CPU tuning guide recommends). Peak memory is unchanged; freed memory
    is reused, not returned before exit. Returns whether it took effect (False off glibc).
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # macOS, Windows, musl: their allocators do not need this
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def release_freed_memory() -> None:
    """Hand memory freed inside glibc's heap back to the kernel now (malloc_trim).

    A long stream of megabyte-sized buffers (corpus preparation) leaves the heap fragmented, and
    resident memory creeping up by a hundred megabytes, unless the freed pages are released.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)
