"""DeepSpeed's getting-started script, unchanged, gives DeepSpeed's own losses and parameters
(``pytest -k deepspeed_api``).

examples/deepspeed_tutorial.py (argparse with add_config_arguments, initialize with
training_data, the forward/backward/step loop, save_checkpoint with a tag and client_state,
load_checkpoint, then the resumed epoch again) runs on 2 ranks with tinyscale.deepspeed. Every
micro-batch loss (30 per rank) and every final parameter equal what DeepSpeed 0.19.8 gave for
the same script and config, exactly: float32 (DeepSpeed reduces no float64 gradients), ZeRO 0,
AdamW (torch_adam), clipping, 2 micro-batches of accumulation. Exact equality is expected, not
luck: both build the same torch AdamW, average over 2 ranks (halving is exact, so dividing
before or after the sum agrees) and see the same batches (DistributedSampler over dp, seed 0).

The default test runs the script in pooled ranks and compares with DeepSpeed's recorded
results (deepspeed_tutorial/deepspeed_0.19.8.json, written by deepspeed_tutorial/record.py).
With --thorough, both run for real: the script under torchrun with tinyscale, under torchrun
with DeepSpeed (DS_ACCELERATOR=cpu, gloo), and under DeepSpeed's own launcher with tinyscale;
all equal the recording.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).parent / "deepspeed_tutorial"
ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "examples" / "deepspeed_tutorial.py"
CONFIG = HERE / "ds_config.json"
sys.path.insert(0, str(HERE))
from record import results  # noqa: E402 - the recording's own reader, so both sides are read alike


def _recorded() -> list[dict]:
    return json.loads((HERE / "deepspeed_0.19.8.json").read_text())


def _in_rank(out: str) -> None:
    spec = importlib.util.spec_from_file_location("deepspeed_tutorial", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = sys.argv
    sys.argv = [str(SCRIPT), "--deepspeed", "--deepspeed_config", str(CONFIG), "--out", out]
    try:
        module.main()
    finally:
        sys.argv = argv
    dist.barrier()


def test_deepspeed_api_tutorial_script_gives_deepspeeds_losses_and_parameters(tmp_path):
    from tinyscale.testing import run_on_ranks

    run_on_ranks(_in_rank, 2, str(tmp_path))
    ours = results(tmp_path)
    assert ours == _recorded()  # every loss and parameter, exactly
    assert all(r["losses"][1] == r["losses"][2] for r in ours)  # the resumed epoch repeats exactly
    assert (tmp_path / "ckpt" / "latest").read_text() == "epoch1"


def _launch(command: list[str], out: Path, **env) -> None:
    out.mkdir()
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **env}
    done = subprocess.run([*command, str(SCRIPT), "--deepspeed", "--deepspeed_config", str(CONFIG), "--out", str(out)],
                          env=full, capture_output=True, text=True, timeout=900, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.thorough
def test_deepspeed_api_tutorial_script_under_torchrun_and_deepspeeds_launcher_equals_deepspeed(tmp_path):
    pytest.importorskip("deepspeed")
    bin_dir = Path(sys.executable).parent
    torchrun = [str(bin_dir / "torchrun"), "--nproc-per-node", "2", "--master-port", "29611"]
    _launch(torchrun, tmp_path / "deepspeed", DS_ACCELERATOR="cpu", TUTORIAL_ENGINE="deepspeed")
    assert results(tmp_path / "deepspeed") == _recorded()  # the recording is what DeepSpeed gives today
    _launch(torchrun, tmp_path / "torchrun")
    assert results(tmp_path / "torchrun") == _recorded()
    if shutil.which("deepspeed", path=str(bin_dir)):
        launcher = [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", "29612"]
        _launch(launcher, tmp_path / "launcher", DS_ACCELERATOR="cpu")
        assert results(tmp_path / "launcher") == _recorded()
    assert torch.load(tmp_path / "torchrun" / "rank0.pt")["path"].endswith("epoch1")
