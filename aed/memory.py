"""Peak tensor memory of a piece of code, measured by running it (oom.py).

    peak = peak_memory(step, device, limit=20e9, existing=[*model.parameters(), ...])  # bytes

CUDA: the caching allocator's `max_memory_allocated`; a real `torch.cuda.OutOfMemoryError`, or a
cuBLAS/cuDNN allocation failure on the full device (`is_out_of_memory`), becomes `OutOfMemory`.

CPU: PyTorch keeps no allocator statistics there, so `LiveTensorMemory` (a TorchDispatchMode)
sees the output of every aten op, forward, backward and optimizer, and counts each storage's bytes
from its creation until it is freed. Frees are seen through a weakref finalizer on the storage:
PyTorch keeps a storage's Python object alive exactly as long as the storage itself, so the
finalizer also fires for activations that autograd saved and no Python variable holds. On our
model the count equalled the c10 CPU allocator's own (the profiler's memory events, to the byte)
and the growth of the process RSS when glibc returns freed memory to the system (checked in
tests/test_oom.py). What it does not see: buffers kernels allocate outside PyTorch's allocator
(oneDNN scratchpads), and freed heap memory glibc keeps, which made a CPU training step's RSS peak
~40% above its live tensors unless MALLOC_MMAP_THRESHOLD_ is set (e.g. to 131072): budget CPU
training runs with that in mind.
"""

import re
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def format_bytes(n) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def parse_bytes(text: str) -> int:
    """'20GB', '512 MB', '1.5GiB', '4e9' -> bytes. K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*(?:([KMGT])(i?)B?|B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"memory size {text!r}: expected a number with an optional unit, e.g. 20GB or 512MiB")
    value, unit, binary = m.groups()
    power = "KMGT".index(unit.upper()) + 1 if unit else 0
    return int(float(value) * (1024 if binary else 1000) ** power)


class OutOfMemory(RuntimeError):
    """A measured piece of code needed more than `limit` bytes. `needed` is how far it got: the
    exact peak, a lower bound when the CPU tracker stopped it, None after a CUDA OOM."""

    def __init__(self, needed, limit):
        self.needed, self.limit = needed, limit
        super().__init__(f"over the {format_bytes(limit)} limit" if limit else "out of device memory")


# Allocation failures that are not the caching allocator's OutOfMemoryError: libraries that
# allocate their own handles or workspaces (cuBLAS, cuDNN, cuFFT, cuSOLVER) report a full device
# with their status code, and a cudaMalloc outside the allocator with CUDA's own message.
_DEVICE_FULL = re.compile(r"\b(CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED|"
                          r"CUSOLVER_STATUS_ALLOC_FAILED)\b|CUDA error: out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Did the device run out of memory? Other errors (wrong shapes, bad kernels) must propagate."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and _DEVICE_FULL.search(str(error)) is not None)


class LiveTensorMemory(TorchDispatchMode):
    """Bytes of live CPU tensor storages while the mode is active: `current` and `peak`.

    Storages that existed before (weights, optimizer state) are counted once passed to `add`.
    With `limit`, the op whose output takes the total past it raises OutOfMemory, as a device
    would: the failed step stops early instead of growing into the machine's real memory.
    `granularity` rounds every storage up as an allocator would (CUDA's caching allocator: 512).

    Two things an op's outputs do not show are followed too. A tensor subclass (FSDP's DTensor
    parameters, gradients and AdamW state) is counted by the plain tensors it wraps (its local
    shard). A storage resized in place (`UntypedStorage.resize_`, not an aten op: FSDP2 frees a
    layer's gathered parameters with resize_(0) and reallocates them with resize_(n)) is counted
    at its new size: `resize_` is wrapped while the mode is active.
    """

    def __init__(self, limit=None, granularity: int = 1):
        super().__init__()
        self.limit, self.granularity = limit, granularity
        self.current = self.peak = 0
        self._sizes = {}  # id(storage) -> bytes; the Python object lives as long as the storage
        self._finalizers = []

    def add(self, tensors) -> None:
        for t in tensors:
            if is_traceable_wrapper_subclass(t):  # DTensor: what it wraps
                self.add(getattr(t, name) for name in t.__tensor_flatten__()[0])
            elif isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._add(t.untyped_storage())

    def _add(self, storage) -> None:
        key, size = id(storage), -(-storage.nbytes() // self.granularity) * self.granularity
        old = self._sizes.get(key)
        if old == size:  # a view or an in-place result: memory we already count
            return
        if old is None:
            self._finalizers.append(weakref.finalize(storage, self._free, key))
        self._sizes[key] = size  # a resized storage (out= ops) is counted at its new size
        self.current += size - (old or 0)
        self.peak = max(self.peak, self.current)
        if self.limit is not None and self.current > self.limit:
            raise OutOfMemory(self.current, self.limit)

    def _free(self, key) -> None:
        self.current -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(tree_leaves(out))
        return out

    def __enter__(self):
        self._resize = resize = torch.UntypedStorage.resize_

        def counted_resize(storage, size):
            out = resize(storage, size)
            self._add(storage)  # may raise OutOfMemory, after the resize, as an allocation would
            return out

        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        for f in self._finalizers:  # storages that outlive the measurement must not call back
            f.detach()
        return super().__exit__(*exc)


def peak_memory(fn, device, limit=None, existing=(), granularity: int = 1) -> int:
    """Run `fn()` once; return the peak bytes of tensor memory on `device` while it ran.

    On CPU, `existing` lists the tensors alive before the call that belong in the total (model,
    gradients, optimizer state); on CUDA the allocator already knows them. Raises OutOfMemory when
    the peak exceeds `limit` bytes (or CUDA runs out of memory first). `granularity`: see
    LiveTensorMemory (CPU only; on CUDA the allocator rounds for real).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        failed = False
        try:
            fn()
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            failed = True  # raised below, outside this block: its traceback holds the step's tensors
        if failed:
            raise OutOfMemory(None, limit)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        with LiveTensorMemory(limit, granularity) as mem:
            mem.add(existing)
            fn()
        peak = mem.peak
    if limit is not None and peak > limit:
        raise OutOfMemory(peak, limit)
    return peak
