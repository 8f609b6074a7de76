"""Train an attention encoder-decoder speech model: `python train.py configs/tiny.yaml [key=value ...]`,
or under torchrun. `python train.py --help` prints the usage and every config key; the run itself is
aed/cli_train.py (installed: `aed-train`)."""

from aed.cli_train import cli

if __name__ == "__main__":
    cli()
