"""Train the reference GPT on the built-in corpus (or your text) with a sharded layout.

Exact commands:
    python scripts/train.py                                   # 8 simulated CPU devices, data=2,fsdp=2,tensor=2
    python scripts/train.py --layout fsdp=8 --steps 200       # another layout
    python scripts/train.py --data my_text.txt --json-log run.jsonl
On a GPU machine the same commands use the GPUs (the simulated-device count only affects the CPU).

Same flags as `shardkit train`; this file only forwards to it.
"""

import sys

from shardkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
