"""Convert a BF16 checkpoint to hpu-fp8, validate, evaluate, write its model card and publish it.

A thin script over the same API as ``hpu-fp8 push`` (hpu_fp8_loader.hub.publish); every option of that
command works here. Examples:

    python scripts/convert_and_push.py ./qwen2-bf16 --repo-id me/qwen2-hpu-fp8 --calibrate --license apache-2.0 \\
        --base-model Qwen/Qwen2-0.5B --kv-cache none --dry-run
    HF_TOKEN=... python scripts/convert_and_push.py ./qwen2-bf16 --repo-id me/qwen2-hpu-fp8 --calibrate ...
"""

from __future__ import annotations

import sys

from hpu_fp8_loader.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["push", *sys.argv[1:]]))
