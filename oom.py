"""OOMptimizer: the largest batch size of every 2D bucket, found by running real training steps.
`python oom.py --help` prints the usage; the command is aed/cli_oom.py (installed: `aed-oom`), the
search aed/memory_oomptimizer.py."""

from aed.cli_oom import main

if __name__ == "__main__":
    main()
