"""Convert checkpoints that aed wrote before DCP (a directory of per-rank `shard-*.pt` files) into
today's format (DCP directories), so that train.py resumes from them and infer.py reads them.

    python tools/upgrade_checkpoint.py runs/old -o runs/old-dcp              # every checkpoint of a run
    python tools/upgrade_checkpoint.py runs/old/ckpt-00001000 -o runs/old-dcp

The earlier layout: `meta.pt` holds everything but the tensors, with the model's keys listed under
"model" and the optimizer's state without its tensors, plus `shards`, the number of ranks that
wrote; `shard-<rank>-of-<n>.pt` holds that rank's tensors as "model/<key>" and
"optimizer/<param id>/<name>". The optimizer's state was keyed by parameter index; DCP keys it
by parameter name, so the run's model and optimizer are built from the checkpoint's own config to
map one to the other. The converted checkpoint keeps the step number and every entry, so a resumed
run continues exactly where the old one stopped.
"""

import argparse
import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from aed.config import from_dict, renamed  # noqa: E402
from aed.model_checkpoint import (COMPLETE, CheckpointError, checkpoint_step, list_checkpoints,  # noqa: E402
                                  unpack_tokenizer)
from aed.train_checkpoint import save_checkpoint, training_tensors  # noqa: E402
from aed.train_config import TrainConfig  # noqa: E402
from aed.train_setup import build_model, build_optimizer  # noqa: E402


def read_rank_shards(path: str) -> dict:
    """The whole state of an earlier checkpoint directory, its tensors back in place."""
    meta = torch.load(os.path.join(path, "meta.pt"), map_location="cpu", weights_only=False)
    if not isinstance(meta, dict) or not isinstance(meta.get("shards"), int):
        raise CheckpointError(f"{path}: not a checkpoint of per-rank shard files (meta.pt has no 'shards')")
    if not os.path.isfile(os.path.join(path, COMPLETE)):
        raise CheckpointError(f"{path}: incomplete (no {COMPLETE} marker: the job stopped while saving it)")
    n = meta.pop("shards")
    tensors = {}
    for rank in range(n):
        tensors |= torch.load(os.path.join(path, f"shard-{rank:03d}-of-{n:03d}.pt"), map_location="cpu",
                              weights_only=False)
    try:
        meta["model"] = {k: tensors.pop(f"model/{k}") for k in meta.get("model", [])}
    except KeyError as e:
        raise CheckpointError(f"{path}: no shard holds {e.args[0]}") from None
    for key, value in tensors.items():  # "optimizer/{param id}/{name}"
        _, pid, name = key.split("/")
        meta["optimizer"]["state"][int(pid)][name] = value
    return meta


def keyed_by_name(state: dict) -> dict:
    """`state` with its model and optimizer as DCP checkpoints hold them (`training_tensors`): the
    run's model and optimizer are built from its config, and the optimizer's state, listed by
    parameter index in the optimizer's order, is loaded by the names at those indices."""
    cfg = from_dict(TrainConfig, renamed(TrainConfig, state["config"]))  # its keys under today's names
    model = build_model(cfg, unpack_tokenizer(state["tokenizer"]).vocab_size, state.get("new_tokens"))
    optimizer = build_optimizer(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    old = state["optimizer"]
    for group, saved in zip(optimizer.param_groups, old["param_groups"]):  # the schedule's initial_lr too
        group.update({k: v for k, v in saved.items() if k != "params"})
    by_name = {"state": {order[i]: s for i, s in old["state"].items()},
               "param_groups": [dict(g, params=[order[i] for i in g["params"]]) for g in old["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True))
    return state | training_tensors(model, optimizer)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a run directory, or one checkpoint directory in it")
    p.add_argument("-o", "--out", required=True, help="run directory to write the converted checkpoints into")
    args = p.parse_args(argv)
    args.path = os.path.normpath(args.path)
    if os.path.isfile(os.path.join(args.path, "meta.pt")):
        paths = [args.path]
    else:
        paths = [q for q in list_checkpoints(args.path) if os.path.isdir(q)]
    if not paths:
        sys.exit(f"upgrade_checkpoint: no checkpoint directory in {args.path}")
    os.makedirs(args.out, exist_ok=True)
    for path in paths:
        state = keyed_by_name(read_rank_shards(path))
        written = save_checkpoint(state, args.out, checkpoint_step(path), keep_last=len(paths))
        print(f"{path} -> {written}", flush=True)


if __name__ == "__main__":
    main()
