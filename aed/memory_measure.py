"""Peak tensor memory of a piece of code, measured by running it (oom.py): on the real device, or
on a simulated CUDA device (`SimulatedDevice`: the real step on fake tensors).

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

Simulated CUDA memory:

    with SimulatedDevice() as sim:                   # build the model and optimizer inside
        model = build_model(cfg, vocab); optimizer = build_optimizer(model, cfg.optim)
        step = TrainingStep(model, optimizer, "bf16", granularity=CUDA_BLOCK)
        peak = step.peak(batch_size, frames, tokens)   # bytes of tensors, as max_memory_allocated
    device_bytes = cuda_device_bytes(peak)           # + what CUDA adds outside the tensors

Why: the paper's memory claims live at 1B parameters on 80 GB GPUs, where long transcripts make
the decoder's B x U x V logits dominate; a CPU cannot hold such a step, but it can run it on fake
tensors (`FakeTensorMode`: every op computes its output's shape, dtype and strides, no data), and
`LiveTensorMemory` counts their storages from creation to free exactly as it does
for real ones. The step is train.py's own (`aed.train_setup.train_step`), so nothing is re-modelled.

Fake tensors have no values, so code that reads data on the host (`int(lens.max())`, `.tolist()`,
boolean-mask indexing, whose output size depends on the mask) cannot run. In a training step those
reads are of lengths, token ids and masks built from them: small integer tensors that follow from
the batch. `HostValues` computes those few tensors for real beside their fake twins, so the reads
get the true answer; a read it cannot answer still fails loudly. The one read that depends on the
model's numbers, "is the gradient norm finite?", answers True: the step does its full update.

What a CUDA device adds on top of the tensors, and how each term is treated:

* modelled, caching-allocator rounding: every block is rounded up to 512 bytes (`CUDA_BLOCK`), and
  `torch.cuda.max_memory_allocated` counts the rounded sizes; `LiveTensorMemory(granularity=512)`
  rounds the same way.
* modelled, cuBLAS workspaces: allocated through the caching allocator since PyTorch 1.11, so
  counted in max_memory_allocated: one per thread that runs matrix products (its own cuBLAS
  handle), and a training step has two, forward on the caller's thread and backward on autograd's
  device thread: `CUBLAS_WORKSPACE` (32 MiB each on Hopper GPUs, PyTorch's default: one at the first forward
  product, one more at the first backward).
* modelled, CUDA context: the driver's and kernels' memory outside the allocator, never in
  max_memory_allocated but on the device: `CUDA_CONTEXT`, taken off the device's memory.
* not modelled, attention kernels and autocast: the step runs the CPU's choice of SDPA kernel and
  CPU autocast's op lists, not CUDA's (whose memory-efficient kernel keeps no B x H x T' x T'
  probabilities, and whose fp32 list differs). Not yet measured here: tests/test_cuda_oom.py
  checks the total against max_memory_allocated on a GPU; until it has run, the margin covers it.
* margin only: fragmentation (reserved minus allocated), the data loader's pinned buffers,
  NCCL's buffers, and anything a kernel allocates beyond its output (cuDNN convolution workspaces
  go through the allocator but depend on the algorithm cuDNN picks at run time).
"""

import os
import re
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary


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


def device_memory(device: torch.device) -> int:
    """The memory a device has in all: a GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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


aten = torch.ops.aten

CUDA_BLOCK = 512  # bytes: the caching allocator rounds every allocation up to a multiple of this
CUBLAS_WORKSPACE = 2 * 32 * 2**20  # forward's and backward's thread, 32 MiB each on Hopper (PyTorch's default)
CUDA_CONTEXT = 600 * 2**20  # driver context + loaded kernels on an H100 with lazy module loading (typical)

# Ops whose output shape depends on their input's values; fake tensors cannot run them.
_DATA_DEPENDENT = {aten.nonzero.default, aten._unique2.default, aten.unique_dim.default,
                   aten.masked_select.default, aten.unique_consecutive.default}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_MAX_HOST_NUMEL = 1 << 22  # a host value is kept for integer/bool tensors up to this size (lengths, ids, masks)


def cuda_device_bytes(tensor_peak: int) -> int:
    """Device memory a step needs whose tensor peak (rounded to CUDA_BLOCK) is `tensor_peak`."""
    return tensor_peak + CUBLAS_WORKSPACE + CUDA_CONTEXT


def allocated_limit(device_memory: int, margin: float) -> int:
    """The largest tensor peak (max_memory_allocated) that fits a device of `device_memory` bytes
    with `margin` of it kept free for the terms only a margin covers."""
    return int(device_memory * (1 - margin)) - CUBLAS_WORKSPACE - CUDA_CONTEXT


def _is_small_integral(t) -> bool:
    return (isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
            and t.numel() <= _MAX_HOST_NUMEL)


class HostValues(TorchDispatchMode):
    """Real values for the small integer and bool tensors of a fake computation.

    Entered inside a FakeTensorMode. An op whose tensor inputs all have real values, and whose
    outputs are small integer/bool tensors, also runs on the real values (factory ops such as
    arange and randint too). Host reads of such tensors (`.item()`, `.tolist()`, `int()`) get
    their value; data-dependent ops (nonzero, unique) get fake outputs of the right size; boolean
    masks in indexing become the long indices they stand for, so the output size is known.
    """

    def __init__(self):
        super().__init__()
        self.values = WeakTensorKeyDictionary()  # fake tensor -> its real value

    def _real(self, x):
        return self.values.get(x) if isinstance(x, FakeTensor) else x  # a real tensor (torch.tensor's data) is its value

    def _known(self, args) -> bool:
        return all(t in self.values for t in tree_flatten(args)[0] if isinstance(t, FakeTensor))

    def _fake_like(self, real):
        """A fake tensor shaped like `real`, made by the fake mode under this one."""
        fake = torch.empty(real.shape, dtype=real.dtype)
        self.values[fake] = real
        return fake

    def _mask_to_indices(self, indices):
        """index/index_put's boolean masks -> the long index tensors they stand for (one per mask dim).
        A mask of unknown value (drawn from random numbers, as BEST-RQ's) selects every position:
        the most memory what follows can take, so the simulated peak stays an upper bound."""
        out = []
        for idx in indices:
            if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool:
                with _disable_current_modes():
                    mask = self._real(idx)
                    real = (torch.ones(idx.shape, dtype=torch.bool) if mask is None else mask).nonzero().unbind(1)
                out.extend(self._fake_like(i) for i in real)
            else:
                out.append(idx)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:  # .item(), int(), .tolist()
            (x,) = args
            if x in self.values:
                with _disable_current_modes():  # the fake mode below would refuse a real tensor
                    return self.values[x].item()
            try:  # the fake mode knows scalars made from Python numbers (AdamW's step count)
                return func(*args)
            except DataDependentOutputException:
                if x.dtype == torch.bool:  # "is the gradient finite?": yes, do the full update
                    return True
                raise RuntimeError(f"simulated step: reads the value of a {x.dtype} tensor {tuple(x.shape)} that "
                                   "depends on the model's numbers (fp16's loss scaler does; use bf16 or fp32)")
        if func in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            args = (args[0], self._mask_to_indices(args[1]), *args[2:])
        known = self._known((args, kwargs))
        if func in _DATA_DEPENDENT:
            if not known:
                raise RuntimeError(f"simulated step: {func} of a tensor of unknown value")
            with _disable_current_modes():
                real = func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
            return tree_map(lambda r: self._fake_like(r) if isinstance(r, torch.Tensor) else r, real)
        out = func(*args, **kwargs)
        flat, spec = tree_flatten(out)
        if known and flat and all(_is_small_integral(t) for t in flat if isinstance(t, torch.Tensor)):
            with _disable_current_modes():
                real = func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
            for fake, r in zip(flat, tree_flatten(real)[0]):
                if isinstance(fake, torch.Tensor):
                    self.values[fake] = r
        return out


class SimulatedDevice:
    """Fake CPU tensors with host values: build the model, its optimizer and run steps inside.

    Fake CUDA tensors would follow CUDA's kernel choices, but autograd's backward needs a real CUDA
    device; fake CPU tensors run the whole step. Exiting ends the simulation: the model built
    inside is unusable after it.
    """

    def __enter__(self):
        self.fake = FakeTensorMode()
        self.host = HostValues()
        self.fake.__enter__()
        self.host.__enter__()
        return self

    def __exit__(self, *exc):
        self.host.__exit__(*exc)
        return self.fake.__exit__(*exc)


@contextmanager
def fake_world(world_size: int):
    """A fake process group of `world_size` ranks in this process, this process its rank 0: FSDP
    shards, all-gathers and reduce-scatters as it would on rank 0 of such a world, and every
    collective moves no data (torch's FakeProcessGroup). For simulating a sharded step; destroyed
    on exit. Refused inside a real distributed run (train.py's preflight measures with the real
    group instead), so a real run never talks to a fake group."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend (private)
    from torch._C._distributed_c10d import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists in this process (a real distributed run?)")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
