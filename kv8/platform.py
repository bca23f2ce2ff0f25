"""The machine an engine runs on, resolved once from the ``device`` option: :class:`Platform`.

``device`` (``auto``, ``cpu``, ``cuda``; vLLM's option) is read here and nowhere else. :meth:`Platform.resolve`
turns it into a frozen :class:`Platform` at the engine boundary (:meth:`kv8.engine.args.EngineArgs.
create_engine_config`, ``kv8 info``), probing the GPU once; every part below receives the object and reads its
fields instead of comparing device strings:

=========================  ===========  ==========================================  ==========================
field / method             CPU          CUDA                                        read by
=========================  ===========  ==========================================  ==========================
``device``                 cpu          cuda                                        loader, runner, caches
``rank_device(rank)``      cpu          cuda:<rank mod GPUs>, made current          worker.load_shard
``memory_available()``     host's free  the GPU's free memory                       cache.budget
``collective_backend``     gloo         nccl                                        distributed.group.TPGroup
``attention_backend``      cpu_fused    triton                                      attention_backend=auto
``cuda_graphs``            False        True                                        EngineConfig
``fp8_tensor_cores``       False        NVIDIA compute capability >= 9.0            the dense backend
``native_fp8``             none         E4M3, E5M2 from 8.9; E4M3FNUZ on AMD gfx94x  the Triton kernels
``compute_units``          None         the GPU's SMs (CUs on AMD)                  the Triton kernels' split
``pinned_memory``          False        True                                        a step's host-to-device copies
``host_reads_sync``        False        True                                        the runner and the sampler
=========================  ===========  ==========================================  ==========================

``native_fp8`` holds KV cache format names (those of :mod:`kv8.quant.formats`, which sits above this module).

Invariant: a Platform describes what the machine *can* do; what an engine *does* (graphs unless
``enforce_eager``, one rank) is the engine config's decision, made from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kv8.validators import check_choice, memory_available

__all__ = ["CPU", "DEVICES", "DEVICE_CHOICES", "FP8_FORMAT_NAMES", "Platform", "cpu_name", "resolve_device"]

# where the model's weights and activations and the KV cache live (vLLM's --device); the scheduler, the block
# pool and the requests' state are always on the host
DEVICES = ("cpu", "cuda")
DEVICE_CHOICES = ("auto", *DEVICES)
# the FP8 KV cache formats by name (kv8.quant.formats owns their layouts)
FP8_FORMAT_NAMES = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz")
_COLLECTIVES = {"cpu": "gloo", "cuda": "nccl"}
_ATTENTION = {"cpu": "cpu_fused", "cuda": "triton"}


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a CUDA GPU, else ``cpu``; ``cpu`` and ``cuda`` as given (any case).
    Whether ``cuda`` is usable is checked by :meth:`Platform.resolve`."""
    name = device.lower() if isinstance(device, str) else device
    check_choice("device", name, DEVICE_CHOICES)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _cuda_native_fp8(capability: tuple[int, int], hip_arch: str | None) -> tuple[str, ...]:
    """The FP8 formats a GPU converts in hardware: AMD gfx94x (MI300) E4M3FNUZ; NVIDIA compute capability >= 8.9
    (Ada, Hopper and later) E4M3 and E5M2; none elsewhere."""
    if hip_arch is not None:
        return ("fp8_e4m3fnuz",) if hip_arch.startswith("gfx94") else ()
    return ("fp8_e4m3", "fp8_e5m2") if capability >= (8, 9) else ()


@dataclass(frozen=True)
class Platform:
    """What the machine of one engine offers (module docstring). Build it with :meth:`resolve`, or with
    :meth:`cpu` / :meth:`cuda` where the machine is given (tests, tools)."""

    kind: str                                 # "cpu" or "cuda"
    name: str = ""                            # the processor or GPU, for messages
    capability: tuple[int, int] | None = None   # CUDA compute capability (None on the CPU)
    hip_arch: str | None = None               # ROCm's gcnArchName (AMD GPUs through torch's CUDA API)
    total_memory: int | None = None           # bytes of GPU memory (None on the CPU)
    compute_units: int | None = None          # streaming multiprocessors (AMD: compute units); None on the CPU

    def __post_init__(self) -> None:
        check_choice("Platform.kind", self.kind, DEVICES)
        if (self.kind == "cuda") != (self.capability is not None):
            raise ValueError(f"Platform.capability={self.capability!r} must be given exactly for kind 'cuda'")

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def cpu(cls) -> Platform:
        return CPU

    @classmethod
    def cuda(cls, capability: tuple[int, int], name: str = "", hip_arch: str | None = None,
             total_memory: int | None = None, compute_units: int | None = None) -> Platform:
        """A CUDA GPU of this compute capability (``hip_arch``: an AMD GPU's gcnArchName under ROCm)."""
        return cls("cuda", name, tuple(capability), hip_arch, total_memory, compute_units)  # type: ignore[arg-type]

    @classmethod
    def resolve(cls, device: str) -> Platform:
        """The platform of option ``device`` (``auto``, ``cpu`` or ``cuda``, any case). ``ValueError`` naming the
        option for an unknown value, and saying what to do for ``cuda`` without a GPU torch can use. Probes the
        current CUDA device once."""
        name = resolve_device(device)
        if name == "cpu":
            return CPU
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device='cuda' but torch sees no CUDA GPU (torch {torch.__version__}, {build}); "
                             "install torch with CUDA (README: the GPU path) on a machine with an NVIDIA GPU, or "
                             "use device='cpu'")
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        hip = str(getattr(props, "gcnArchName", "")) if torch.version.hip is not None else None
        units = getattr(props, "multi_processor_count", None)
        return cls.cuda(torch.cuda.get_device_capability(index), props.name, hip, int(props.total_memory),
                        None if units is None else int(units))

    # ---- what the machine offers ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The torch device of the engine's tensors (for CUDA the current GPU; a rank's own: :meth:`rank_device`)."""
        return torch.device(self.kind)

    @property
    def collective_backend(self) -> str:
        """The torch.distributed backend of a tensor-parallel group: ``nccl`` on CUDA (GPU to GPU, no copy
        through the host), ``gloo`` on the CPU."""
        return _COLLECTIVES[self.kind]

    @property
    def attention_backend(self) -> str:
        """What ``attention_backend=auto`` runs: ``triton`` on CUDA, ``cpu_fused`` on the CPU (which falls back
        to ``reference`` where kv8's kernels do not build: :func:`kv8.attention.backend.get_backend`)."""
        return _ATTENTION[self.kind]

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps can be captured and replayed as CUDA graphs."""
        return self.kind == "cuda"

    @property
    def fp8_tensor_cores(self) -> bool:
        """Whether the GPU multiplies FP8 with per-row scales (``torch._scaled_mm``: NVIDIA sm_90 and newer)."""
        return self.capability is not None and self.hip_arch is None and self.capability >= (9, 0)

    @property
    def native_fp8(self) -> tuple[str, ...]:
        """The FP8 KV cache formats (names of :data:`FP8_FORMAT_NAMES`) the device converts in hardware."""
        return () if self.capability is None else _cuda_native_fp8(self.capability, self.hip_arch)

    @property
    def pinned_memory(self) -> bool:
        """Whether host tensors bound for the device can be page-locked, so that copies run asynchronously."""
        return self.kind == "cuda"

    @property
    def host_reads_sync(self) -> bool:
        """Whether reading a device tensor on the host (``.tolist()``, ``int(t)``) waits for the device: a decode
        step does it once (:mod:`kv8.engine.runner`). False on the CPU, where the tensors are host memory."""
        return self.kind != "cpu"

    def rank_device(self, rank: int) -> torch.device:
        """The device of tensor-parallel rank ``rank``: the CPU, or GPU ``rank`` modulo the GPUs this process sees
        (made the current one)."""
        if self.kind == "cpu":
            return torch.device("cpu")
        gpu = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        return gpu

    def gpu_memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the current CUDA device now: kv8's one query of GPU memory."""
        if self.kind != "cuda":
            raise ValueError(f"gpu_memory_info: platform {self.kind!r} has no GPU")
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def memory_available(self) -> int | None:
        """Bytes free now for the KV cache: the GPU's, or the host's (None where it cannot be read)."""
        if self.kind == "cuda":
            return self.gpu_memory_info()[0]
        return memory_available()

    def host_tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        """``values`` (a list, or nested lists) as a host tensor to copy to the device with ``non_blocking=True``:
        page-locked where :attr:`pinned_memory`, so that the copy does not wait (a copy from pageable memory
        waits for the device). Torch's caching host allocator keeps the block until the copy has run, so the
        tensor may be dropped at once."""
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory() if self.pinned_memory else t

    def to_device(self, values: Any, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """``values`` as a tensor on ``device`` (default :attr:`device`), copied without waiting on CUDA (on the
        CPU the host tensor itself)."""
        return self.host_tensor(values, dtype).to(device or self.device, non_blocking=True)

    def describe(self) -> str:
        """The device in words, for ``kv8 info`` and logs: the GPU's name, memory and compute capability, or
        the CPU's name and torch threads."""
        if self.kind == "cuda":
            assert self.capability is not None
            memory = f", {self.total_memory / 2**30:.0f} GiB" if self.total_memory else ""
            return f"cuda ({self.name}{memory}, compute capability {self.capability[0]}.{self.capability[1]})"
        name = cpu_name()
        threads = f"{torch.get_num_threads()} threads"
        return f"cpu ({name}, {threads})" if name else f"cpu ({threads})"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


CPU = Platform("cpu")
