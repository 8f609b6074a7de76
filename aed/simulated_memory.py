"""A CUDA device's training memory, simulated on a CPU: the real step on fake tensors.

    with SimulatedDevice() as sim:                   # build the model and optimizer inside
        model = build_model(cfg, vocab); optimizer = build_optimizer(model, cfg.optim)
        step = TrainingStep(model, optimizer, "bf16", granularity=CUDA_BLOCK)
        peak = step.peak(batch_size, frames, tokens)   # bytes of tensors, as max_memory_allocated
    device_bytes = cuda_device_bytes(peak)           # + what CUDA adds outside the tensors

Why: the paper's memory claims live at 1B parameters on 80 GB GPUs, where long transcripts make
the decoder's B x U x V logits dominate; a CPU cannot hold such a step, but it can run it on fake
tensors (`FakeTensorMode`: every op computes its output's shape, dtype and strides, no data), and
aed/memory.py's `LiveTensorMemory` counts their storages from creation to free exactly as it does
for real ones. The step is train.py's own (`aed.training.train_step`), so nothing is re-modelled.

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
  device thread: `CUBLAS_WORKSPACE` (measured on an H200, torch 2.11: +32 MiB at the first forward
  product, +32 MiB more at the first backward).
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

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

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
