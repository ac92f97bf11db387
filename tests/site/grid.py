"""Inputs for the memory calculator's checks, and how the site's tests find their tools.

`calculator_grid(n)` draws n layouts (a seeded sample of every input the page takes, some
of them impossible on purpose) plus custom models that reach every branch of the
activation formula; `run_node` runs docs/assets/calculator.js's `estimate` on them.
`require` and `unavailable`: a missing tool skips a test locally and fails it under CI.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR_JS = ROOT / "docs" / "assets" / "calculator.js"
CHOICES = dict(
    model=["tiny", "small", "gpt2-124m", "llama-1b"],
    dtype=["bf16", "fp16", "fp32"], optimizer=["adamw", "sgd_momentum", "sgd"],
    dp=[1, 2, 3, 8, 64], tp=[1, 2, 4, 3], pp=[1, 2, 4, 3], cp=[1, 2, 4],
    zero_stage=[0, 1, 2, 3], offload=["none", "none", "cpu", "nvme"], offload_params=["none", "none", "cpu"],
    micro_batch=[1, 2, 8], seq_len=[128, 1024, 4096, 1000], num_microbatches=[1, 2, 8],
    checkpointing=["none", "full", "selective", "offload"],
)
CUSTOM = [  # every branch of block_saved_bytes: sdpa/math, dropout, GQA, explicit ffn, tied
    dict(model="custom", n_layer=3, d_model=96, n_head=6, n_kv_head=2, vocab_size=1000, attn_impl="math"),
    dict(model="custom", n_layer=5, d_model=128, n_head=8, dropout=0.1, ffn_hidden=300, tie_embeddings=True),
    dict(model="custom", n_layer=4, d_model=64, n_head=4, dropout=0.1, attn_impl="math"),
    dict(model="custom", n_layer=2, d_model=4096, n_head=32, n_kv_head=8, vocab_size=32000),
]


def calculator_grid(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    grid = [{k: rng.choice(v) for k, v in CHOICES.items()} for _ in range(n)]
    for i, custom in enumerate(CUSTOM):
        for policy in ("none", "full", "selective", "offload"):
            for cp in (1, 2):  # cp 2: ring attention's block (the planner's count)
                grid.append({**grid[i], **custom, "checkpointing": policy, "tp": 1, "pp": 1, "cp": cp,
                             "offload": "none", "offload_params": "none"})
    return grid


def unavailable(message: str):
    """Something a test needs is missing: skip locally, fail under CI (CI=true)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: these tests must run)")
    pytest.skip(message)


def require(tool: str, install: str) -> str:
    """The tool's path (a name on PATH or an absolute path); `unavailable` without it."""
    path = shutil.which(tool) or (tool if os.path.isabs(tool) and os.access(tool, os.X_OK) else None)
    if path is None:
        unavailable(f"{tool} is not installed: {install}")
    return path


NODE_INSTALL = "apt-get install -y nodejs"
# Each input becomes [result, null] or [null, error message]: node prints one JSON list.
_NODE_SCRIPT = """
const {estimate} = require(process.argv[1]);
const grid = JSON.parse(require("fs").readFileSync(0, "utf8"));
console.log(JSON.stringify(grid.map((x) => { try { return [estimate(x), null]; }
                                           catch (e) { return [null, e.message]; } })));
"""


def run_node(grid: list[dict]) -> list[tuple[dict | None, str | None]]:
    node = require("node", NODE_INSTALL)
    done = subprocess.run([node, "-e", _NODE_SCRIPT, str(CALCULATOR_JS)], input=json.dumps(grid),
                          capture_output=True, text=True, timeout=60, check=True)
    return [tuple(row) for row in json.loads(done.stdout)]
