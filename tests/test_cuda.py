"""The CUDA paths, for the first machine with a GPU: `make gpu-check` (skipped without one).

Each test runs one path end to end that the CPU suite cannot: a bf16 training step, DDP over
NCCL, FSDP in bf16, an OOM search against real out-of-memory errors, bf16 batched inference, a checkpoint
written on the GPU read on the CPU, and a converted NeMo model giving the same answers on both.
"""

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_nemo_convert import FIXTURES, convert
from test_train import ROOT, SMALL

from aed.data_audio import FeatureConfig, SpecAugment, num_frames
from aed.data_batch import Batch
from aed.data_tokenizer import Tokenizer
from aed.decode_search import DecodingOptions
from aed.decode_transcribe import transcribe
from aed.memory_oomptimizer import TrainingStep, optimize
from aed.model import AED, AEDConfig
from aed.model_checkpoint import LoadedModel, load_model, pack_dir, read_checkpoint
from aed.model_encoder import ConvSubsampling
from aed.train_checkpoint import save_checkpoint
from aed.train_setup import train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MINI = Path(ROOT) / "data" / "mini"
CFG = AEDConfig(n_mels=80, vocab_size=528, pad_id=1, enc_d_model=64, enc_layers=2, enc_heads=2, subsampling_channels=16,
                dec_d_model=64, dec_layers=1, dec_heads=2, dec_max_len=64)


def run(cmd: list, timeout: int = 300) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{p.stderr[-4000:]}"
    return p


def random_batch(b: int, frames: int, tokens: int, device) -> Batch:
    feat_lens = torch.full((b,), frames)
    return Batch(torch.randn(b, frames, CFG.n_mels), feat_lens, torch.randint(2, CFG.vocab_size, (b, tokens)),
                 torch.full((b,), tokens), torch.full((b,), 2), [f"x{i}" for i in range(b)], list(range(b)), []
                 ).to(device)


def test_one_bf16_training_step_updates_the_weights():
    model = AED(CFG).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    batch = random_batch(4, 200, 12, "cuda")
    result = train_step(model, [batch], optimizer, torch.amp.GradScaler("cuda", enabled=False),
                        SpecAugment().train(), "bf16", clip_grad=1.0, num_targets=4 * 10)
    assert result.updated and torch.isfinite(result.loss)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: fp32 master weights
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_train_py_under_torchrun_with_nccl_then_its_checkpoint_loads_on_cpu(tmp_path):
    """train.py on the GPU as torchrun launches it (at world size 1 without a process group: the
    next test covers DDP over NCCL)."""
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py",
         "configs/tiny.yaml", f"run_dir={tmp_path}", *SMALL, "max_steps=2", "ckpt_every=2", "precision=bf16"])
    ckpt = read_checkpoint(str(tmp_path / "ckpt-00000002"), ("model", "optimizer"))
    assert all(v.device.type == "cpu" for v in ckpt["model"].values())
    asr = load_model(str(tmp_path), device="cpu")
    results, _ = transcribe(asr, [str(MINI / "examples" / "en_asr_16k.wav")], DecodingOptions(max_new_tokens=5))
    assert results[0].error is None


def test_ddp_over_nccl_all_reduces_gradients(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl')\n"
        "torch.cuda.set_device(0)\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).cuda())\n"
        "model(torch.ones(2, 8, device='cuda')).sum().backward()\n"
        "t = torch.ones(1, device='cuda')\n"
        "dist.all_reduce(t)\n"
        "assert t.item() == dist.get_world_size() == 1\n"
        "print('nccl ok', dist.get_backend())\n"
        "dist.destroy_process_group()\n")
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)])
    assert "nccl ok nccl" in p.stdout


def test_fsdp_over_nccl_computes_in_bf16_and_keeps_fp32_shards(tmp_path):
    """aed.train_distributed.shard's CUDA policy: bf16 parameters and compute, fp32 gradient reduction and
    fp32 sharded master weights that the step updates (a world of one: one GPU is enough)."""
    script = tmp_path / "fsdp.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.tensor import DTensor\n"
        "from aed.model import AED, AEDConfig\n"
        "from aed.train_distributed import shard\n"
        "dist.init_process_group('nccl')\n"
        "torch.cuda.set_device(0)\n"
        f"model = shard(AED(AEDConfig(**{dataclasses.asdict(CFG)!r})).cuda(), torch.device('cuda', 0), 1, 'bf16')\n"
        "assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        "before = [p.detach().full_tensor().clone() for p in model.parameters()]\n"
        "feats, lens = torch.randn(2, 200, 80, device='cuda'), torch.tensor([200, 150], device='cuda')\n"
        "seen = []  # what a layer computes with: its gathered parameters (FSDP's pre-forward hook runs first)\n"
        "model.encoder.layers[0].register_forward_pre_hook(lambda m, args: seen.append(next(m.parameters()).dtype))\n"
        "tokens = torch.randint(2, 528, (2, 8), device='cuda')\n"
        "token_lens, prompt_lens = torch.tensor([8, 6], device='cuda'), torch.tensor([2, 2], device='cuda')\n"
        "with torch.autocast('cuda', torch.bfloat16):  # as train_step runs it: norms in fp32 on bf16 weights\n"
        "    loss, n = model(feats, lens, tokens, token_lens, prompt_lens)\n"
        "assert seen == [torch.bfloat16], seen\n"
        "loss.backward()\n"
        "assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)\n"
        "optimizer.step()\n"
        "assert any(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))\n"
        "print('fsdp ok')\n"
        "dist.destroy_process_group()\n")
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)])
    assert "fsdp ok" in p.stdout


def test_train_py_fsdp_over_nccl_in_bf16_then_infer_reads_it_on_cpu(tmp_path):
    """Sharded over 2 GPUs where the machine has them, else over a group of one on its one GPU: the
    same step, nccl collectives, bf16 policy and DCP checkpoint, with nothing to divide."""
    ranks = min(2, torch.cuda.device_count())
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py",
             "configs/tiny.yaml", f"run_dir={tmp_path}", *SMALL, "max_steps=3", "ckpt_every=3", "precision=bf16",
             "train.strategy=fsdp"])
    assert f"sharded over {ranks} rank(s) (FSDP2)" in p.stderr
    asr = load_model(str(tmp_path), device="cpu")
    results, _ = transcribe(asr, [str(MINI / "examples" / "en_asr_16k.wav")], DecodingOptions(max_new_tokens=5))
    assert results[0].error is None


def test_compiled_bf16_blocks_train_as_eager_ones_and_keep_one_graph_per_length():
    """train.compile on CUDA: inductor's Triton kernels in bf16 autocast, against the eager step at
    the same weights and batch (bf16 rounding: the loss within 1%), over four lengths. On the CPU the
    blocks, which hold no convolution, keep one graph for every length (docs/training.md);
    here the shapes after the second must add no graph either."""
    from test_train_compile import SHAPES, padded_batch, setup_of
    from torch._dynamo.utils import counters

    from aed.train_setup import compile_layers, count_targets

    losses, graphs = {}, []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        setup = setup_of("precision=bf16", device="cuda")
        if compiled:
            compile_layers(setup.model)
        losses[compiled] = []
        for i, shape in enumerate(SHAPES[:4]):
            batch = padded_batch(setup, *shape, seed=i).to("cuda")
            n = count_targets(setup.model, [batch])
            torch.manual_seed(100 + i)
            result = train_step(setup.model, [batch], setup.optimizer, setup.scaler, setup.spec_augment, "bf16",
                                clip_grad=1e9, num_targets=n)
            losses[compiled].append(result.loss.item() / n)
            graphs.append(counters["stats"]["unique_graphs"])
    assert losses[True] == pytest.approx(losses[False], rel=1e-2), losses
    assert graphs[-1] == graphs[-3] > 0, graphs  # the compiled run's graphs after its second shape and its last


def test_checkpointed_fsdp_step_over_nccl_trains_as_the_plain_one(tmp_path):
    """activation_checkpointing=both under FSDP2 in bf16 over NCCL: FSDP gathers each layer again
    to recompute it; the losses equal the plain run's (same seeds, no dropout in configs/tiny.yaml)."""
    losses = {}
    for ckpt in ("none", "both"):
        run_dir = tmp_path / ckpt
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py",
             "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, "max_steps=4", "precision=bf16",
             "train.strategy=fsdp", f"activation_checkpointing={ckpt}"])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[ckpt] = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses["none"]) == 4 and losses["both"] == pytest.approx(losses["none"], rel=1e-3), losses


def test_oom_search_bisects_on_real_out_of_memory_errors(caplog):
    """oom.py on a GPU: the search runs capped at the budget less the margin (here 1.5 GB x 0.9), so
    the doubling must hit a genuine CUDA OOM and back off; training then has the whole budget. The
    margin is needed: on an H200 the search's answer (peak 94% of the cap) ran out of memory when
    rerun under the same cap after the failed larger batch had left the allocator fragmented."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    budget, margin = 1.5 * 2**30, 0.1
    torch.cuda.set_per_process_memory_fraction((1 - margin) * budget / total)
    try:
        model = AED(dataclasses.replace(CFG, enc_d_model=256, enc_heads=4, dec_d_model=256, dec_heads=4)).cuda()
        step = TrainingStep(model, torch.optim.AdamW(model.parameters()), "bf16")
        with caplog.at_level(logging.INFO):
            rows = optimize(step, [(20.0, num_frames(20 * 16000), 60)], limit=None, start=16)
        assert "does not fit" in caplog.text  # a real torch.cuda.OutOfMemoryError was caught
        size = rows[0]["batch_size"]
        assert size >= 1 and rows[0]["peak"] <= (1 - margin) * budget
        torch.cuda.set_per_process_memory_fraction(budget / total)
        step.peak(size, num_frames(20 * 16000), 60)  # the answer fits the budget after the failures
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_bf16_batched_inference():
    tokenizer = Tokenizer.load(str(MINI / "tokenizer"))
    model = AED(dataclasses.replace(CFG, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad)).cuda().eval()
    asr = LoadedModel(model, tokenizer, FeatureConfig(n_mels=80), "random weights")
    wavs = sorted(str(p) for p in (MINI / "audio").glob("train_en_*.flac"))[:8]
    results, timings = transcribe(asr, wavs, DecodingOptions(max_new_tokens=8), dtype=torch.bfloat16)
    assert len(results) == len(wavs) and all(r.error is None for r in results)
    assert all(0 < len(r.tokens) <= 8 and max(r.tokens) < tokenizer.vocab_size for r in results)
    assert timings.rtfx > 0


def test_subsampling_without_autograd_in_groups_of_rows_on_cuda(monkeypatch):
    """The GPU's group size, with its in-place ops: the training path's output, in fp32 and bf16."""
    torch.manual_seed(0)
    sub = ConvSubsampling(n_mels=20, channels=4, d_model=8).cuda()
    feats, lens = torch.randn(5, 90, 20, device="cuda"), torch.tensor([90, 37, 61, 90, 12], device="cuda")
    monkeypatch.setattr("aed.model_encoder.GPU_SUBSAMPLING_ELEMENTS", 2 * 4 * 45 * 10)  # 2 rows' first conv output
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            reference, reference_lens = sub(feats, lens)
            with torch.no_grad():
                y, y_lens = sub(feats, lens)
        torch.testing.assert_close(y, reference)
        assert torch.equal(y_lens, reference_lens)


def test_converted_nemo_model_on_cuda_matches_cpu(tmp_path):
    out = tmp_path / "canary.pt"
    convert(FIXTURES / "canary.nemo", out)
    ref = torch.load(FIXTURES / "canary.ref.pt", weights_only=False)
    cpu, gpu = load_model(out, "cpu").model, load_model(out, "cuda").model
    for u in ref["utterances"]:
        feats, lens = u["feats"][None], torch.tensor([u["feat_len"]])
        with torch.no_grad():
            a, _ = cpu.encode(feats, lens)
            b, _ = gpu.encode(feats.cuda(), lens.cuda())
        torch.testing.assert_close(b.cpu(), a, atol=2e-3, rtol=2e-3)  # TF32 convolutions on the GPU


def test_a_checkpoint_saved_from_gpu_tensors_loads_on_cpu(tmp_path):
    model = AED(CFG).cuda()
    save_checkpoint({"model": model.state_dict(), "model_config": dataclasses.asdict(CFG),
                     "features": dataclasses.asdict(FeatureConfig(n_mels=80)),
                     "tokenizer": pack_dir(str(MINI / "tokenizer"))}, str(tmp_path), 1, keep_last=1)
    loaded = load_model(str(tmp_path / "ckpt-00000001"), "cpu").model
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_compiled_step_as_a_cuda_graph_gives_eager_tokens(tmp_path):
    """The committed word model on the GPU: `load_model(compile=True)` captures the step as a CUDA graph
    (mode reduce-overhead); greedy, beam and joint decoding give eager decoding's transcripts, in fp32
    and under bf16 autocast. Its speed (target: >= 2x eager at batch 1) is the benchmark's to measure:
    bench/infer_speed_bench.py --device cuda, which make gpu-check runs."""
    from test_model_static import SEARCHES, WORD_MODEL, word_files
    paths, _ = word_files(tmp_path, 6, seed=5)
    eager, compiled = load_model(WORD_MODEL, "cuda"), load_model(WORD_MODEL, "cuda", compile=True)
    assert compiled.compiled.mode == "reduce-overhead"
    for dtype in (None, torch.bfloat16):
        for name, options in SEARCHES.items():
            ref, _ = transcribe(eager, paths, options, pnc=False, dtype=dtype)
            got, _ = transcribe(compiled, paths, options, pnc=False, dtype=dtype)
            assert [r.pred_text for r in got] == [r.pred_text for r in ref], (name, dtype)


def test_int8_weights_are_refused_on_cuda():
    from test_model_static import WORD_MODEL
    with pytest.raises(ValueError, match="CPUs only"):
        load_model(WORD_MODEL, "cuda", int8=True)
