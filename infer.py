"""Transcribe or translate audio files with a trained model: `python infer.py --ckpt runs/tiny a.wav ...`
(`--stream` to decode while the audio arrives). `python infer.py --help` prints the usage and every
flag; the command is aed/cli_infer.py (installed: `aed-infer`), its streaming input and output
aed/cli_stream.py."""

from aed.cli_infer import main

if __name__ == "__main__":
    main()
