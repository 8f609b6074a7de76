"""train.compile and activation_checkpointing on the CPU: compiled blocks train as eager ones do
(with the attention guide too), new batch shapes stop recompiling once the shapes are dynamic, a
compiled run's batches take one shape per bucket, for which train.py compiles the blocks, and
checkpointed steps give the plain step's losses, under FSDP2 too.

The tests compile with the aot_eager backend: the graphs dynamo captures and AOTAutograd's forward
and backward, without inductor's code generation, which takes a minute per graph on a CPU.
tests/test_cuda.py runs inductor's kernels in bf16 on a GPU."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from aed.data_batch import Collate
from aed.data_tokenizer import Tokenizer
from aed.memory_oomptimizer import artificial_batch
from aed.train_config import load_train_config
from aed.train_data import build_training_data
from aed.train_distributed import cleanup, init_distributed
from aed.train_setup import build_training_setup, compile_layers, count_targets, train_step
from test_train import run_train

SMALL = ["model.enc_d_model=64", "model.enc_layers=2", "model.enc_heads=2", "model.dec_d_model=64",
         "model.dec_layers=2", "model.dec_heads=2", "model.subsampling_channels=16", "model.dec_max_len=128"]
# Dropout on: recomputation must replay its masks. Off where compiled: a compiled graph draws its own.
DROPOUT = ["model.enc_dropout=0.1", "model.dec_dropout=0.1"]
# (batch, frames, tokens): buckets of several lengths; the last row of each batch is shorter (padding)
SHAPES = [(4, 300, 20), (3, 420, 31), (6, 200, 12), (2, 610, 44), (5, 260, 17)]
# Reductions are reordered by the compiled graphs and by recomputation: equal up to float rounding.
LOSS_RTOL = 1e-5
# Of the whole gradient's norm (single near-zero entries are rounding noise). Each SGD step carries the
# rounding into the weights and the next gradient: the gap grew from 4e-6 at the first step to 6e-5 at
# the fifth (1.5e-4 there in one full `make test`). A step that missed one update (stale weights): 0.8.
GRAD_RTOL = 1e-3


def setup_of(*overrides, seed=0, device="cpu"):
    """configs/tiny.yaml with SMALL, trained by SGD: AdamW's first updates are +-lr whatever a
    gradient's size, so the rounding noise of gradients that are zero in exact arithmetic (keys'
    biases, a convolution's bias before BatchNorm) would become differences in the weights; SGD's
    updates keep them as small as the noise, and later steps still check that the compiled blocks
    read the updated weights."""
    torch.manual_seed(seed)
    setup = build_training_setup(load_train_config("configs/tiny.yaml", [*SMALL, *overrides]), torch.device(device))
    setup.optimizer = torch.optim.SGD(setup.model.parameters(), lr=0.05)
    return setup


def padded_batch(setup, batch_size, frames, tokens, seed):
    torch.manual_seed(seed)
    b = artificial_batch(batch_size, frames, tokens, setup.cfg.model.n_mels, setup.tokenizer.vocab_size, "cpu")
    b.feat_lens[-1], b.token_lens[-1] = frames * 2 // 3, tokens - 3
    return b


def train(setup, shapes=SHAPES, first=0):
    """Steps at each shape, SHAPES[first] on: [(loss per target, flat gradient)], with the same batch,
    SpecAugment and dropout masks per step in every run."""
    out = []
    for i, shape in enumerate(shapes, first):
        batch = padded_batch(setup, *shape, seed=i)
        n = count_targets(setup.model, [batch])
        torch.manual_seed(100 + i)
        result = train_step(setup.model, [batch], setup.optimizer, setup.scaler, setup.spec_augment, setup.precision,
                            clip_grad=1e9, num_targets=n)
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in setup.model.parameters()]
        grad = torch.cat([g.reshape(-1) for g in grads if g is not None])
        out.append((result.loss.item() / n, grad.clone()))
    return out


def assert_same_training(a, b):
    for step, ((la, ga), (lb, gb)) in enumerate(zip(a, b)):
        assert lb == pytest.approx(la, rel=LOSS_RTOL), step
        assert (ga - gb).norm() <= GRAD_RTOL * ga.norm(), (step, ((ga - gb).norm() / ga.norm()).item())


@pytest.fixture(scope="module")
def eager():
    return train(setup_of())


@pytest.fixture(scope="module")
def eager_dropout():
    return train(setup_of(*DROPOUT))


def guided(setup):
    """train.attention_guide_to=ctc: the decoder blocks hand their cross-attention weights out (a list
    each appends to) to the guide's loss."""
    setup.model.attention_guide, setup.model.guide_to = 1.0, "ctc"
    return setup


@pytest.mark.slow(seconds=45)
def test_compiled_blocks_train_as_eager_ones_and_stop_recompiling(eager):
    """With the attention guide on, so that the compiled decoder blocks also hand their weights out;
    the FSDP test below compiles blocks without it."""
    plain = train(guided(setup_of()))
    assert plain[0][0] > eager[0][0] * (1 + 1e-3)  # the guide's term is in the loss
    torch._dynamo.reset()
    counters.clear()
    setup = setup_of()
    assert compile_layers(setup.model, backend="aot_eager") == 4  # 2 encoder layers + 2 decoder blocks
    guided(setup)
    compiled = train(setup, SHAPES[:2])
    graphs = counters["stats"]["unique_graphs"]
    compiled += train(setup, SHAPES[2:], first=2)
    # The second shape may recompile once with its dimensions dynamic; three new shapes after it add nothing.
    assert counters["stats"]["unique_graphs"] == graphs > 0
    assert_same_training(plain, compiled)
    setup.model.eval()  # validation runs the blocks eagerly: its shapes would use up the recompile limit
    with torch.no_grad():
        b = padded_batch(setup, 2, 350, 25, seed=9)
        setup.model(b.feats, b.feat_lens, b.tokens, b.token_lens, b.prompt_lens)
    assert counters["stats"]["unique_graphs"] == graphs
    assert all(k.startswith(("encoder.", "decoder.", "ctc.")) for k in setup.model.state_dict())  # keys unchanged


@pytest.mark.slow(seconds=15)
def test_a_compiled_block_saves_no_mask_its_saved_output_gives():
    """The decoder's ReLU output, saved for the next product, also gives the ReLU's backward: the
    compiled block saves no boolean mask of those (B, U, 4D) rows beside it (inductor's CPU code
    stores booleans slowly). aot_eager_decomp_partition: inductor's decompositions and partitioner,
    which choose what is saved, without its code generation."""
    torch._dynamo.reset()
    setup = setup_of()
    compile_layers(setup.model, backend="aot_eager_decomp_partition")
    block, d_ff = setup.model.decoder.layers[0], 4 * setup.cfg.model.dec_d_model
    x, memory = torch.randn(3, 11, 64, requires_grad=True), torch.randn(3, 40, 64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        block(x, None, None, torch.ones(3, 1, 1, 40, dtype=torch.bool), memory=memory)  # as in training
    assert any(t.shape[-1] == d_ff and t.dtype == torch.float32 for t in saved)  # the ReLU's output
    assert not [t.shape for t in saved if t.dtype == torch.bool and t.shape[-1] == d_ff]


@pytest.mark.parametrize("where", ["encoder", "decoder", "both"])
def test_checkpointed_steps_train_as_plain_ones(eager_dropout, where):
    assert_same_training(eager_dropout, train(setup_of(*DROPOUT, f"activation_checkpointing={where}")))


@pytest.mark.slow(seconds=80)
def test_fsdp_step_compiled_and_checkpointed_trains_as_eager_plain_one(eager):
    """FSDP2 over a group of one, as train.strategy=fsdp runs on one process: compiled blocks inside
    fully_shard's hooks, and checkpointed ones that gather their weights again to recompute."""
    init_distributed(group_of_one=True)
    try:
        setup = setup_of("train.strategy=fsdp", "activation_checkpointing=both")
        compile_layers(setup.model, backend="aot_eager")
        fsdp = train(setup, SHAPES[:2])
    finally:
        cleanup()
    assert_same_training(eager, fsdp)


def test_activation_checkpointing_is_checked():
    with pytest.raises(Exception, match="activation_checkpointing: expected one of none, encoder, decoder, both"):
        load_train_config("configs/tiny.yaml", ["activation_checkpointing=all"])
    with pytest.raises(Exception, match="has no transformer decoder"):
        setup_of("objective=rnnt", "activation_checkpointing=decoder")


def test_collate_pads_a_batch_to_the_first_bucket_that_holds_it():
    items = [{"feats": torch.ones(t, 4), "tokens": [5] * u, "prompt_len": 1, "transcribed": True,
              "audio_filepath": f"{t}.wav", "index": t} for t, u in ((90, 7), (120, 9))]
    buckets = [(100, 8), (150, 8), (150, 16), (300, 40)]
    batch = Collate(0, buckets)(items)
    assert batch.feats.shape == (2, 150, 4) and batch.tokens.shape == (2, 16)  # (120, 9) fits (150, 16) first
    assert batch.feat_lens.tolist() == [90, 120] and batch.token_lens.tolist() == [7, 9]
    assert batch.feats[1, 120:].abs().sum() == 0 and (batch.tokens[0, 7:] == 0).all()
    assert Collate(0, buckets[:1])(items).feats.shape == (2, 120, 4)  # held by no bucket: its own longest
    assert Collate(0)(items).tokens.shape == (2, 9)


def test_with_compile_every_training_batch_takes_its_buckets_shape():
    """train.compile pads each batch to its bucket's bounds: a bounded set of shapes for the compiled
    blocks, one per bucket, where padding to the longest item gives a new one almost every batch."""
    small = ["train.num_workers=0", "train.max_duration=8"]  # a few utterances per batch
    cfg = load_train_config("configs/tiny.yaml", [*small, "compile=true", "train.speed_perturb=[0.9,1.0]"])
    tokenizer = Tokenizer.load(cfg.train.tokenizer)
    data = build_training_data(cfg, tokenizer, rank=0, world_size=1)
    assert len(data.pad_to) == data.bins.num_buckets
    loader = iter(data.loader(torch.device("cpu")))
    shapes = {(b.feats.shape[1], b.tokens.shape[1]) for b in (next(loader) for _ in range(60))}
    assert shapes <= set(data.pad_to) and len(shapes) > 1, (shapes, data.pad_to)
    plain = build_training_data(load_train_config("configs/tiny.yaml", small), tokenizer, 0, 1)
    assert plain.pad_to is None
    loader = iter(plain.loader(torch.device("cpu")))
    assert len({(b.feats.shape[1], b.tokens.shape[1]) for b in (next(loader) for _ in range(60))}) > len(shapes)


def test_compile_true_compiles_the_blocks_for_the_buckets_shapes(tmp_path, monkeypatch):
    import aed.cli_train

    compiled = []
    monkeypatch.setattr(aed.cli_train, "compile_layers", lambda model, shapes: compiled.append(shapes) or 4)  # no inductor
    p = run_train(tmp_path / "c", "compile=true", "max_steps=1", "val.every=100")
    # one call, told how many shapes to hold: the run's buckets, as its log line counts them
    assert len(compiled) == 1 and compiled[0] > 1 and f"({compiled[0]} buckets;" in p.stderr
