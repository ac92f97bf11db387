"""Write what DeepSpeed gives for examples/deepspeed_tutorial.py to deepspeed_0.19.8.json.

    python tests/engine/deepspeed_tutorial/record.py RUN_DIR   # RUN_DIR/rank{0,1}.pt from DeepSpeed's run

RUN_DIR comes from `DS_ACCELERATOR=cpu TUTORIAL_ENGINE=deepspeed torchrun --nproc-per-node 2
examples/deepspeed_tutorial.py --deepspeed --deepspeed_config tests/engine/deepspeed_tutorial/ds_config.json
--out RUN_DIR` (`pytest -k deepspeed_api --thorough` runs it and checks this file against it).
"""

import json
import sys
from pathlib import Path

import torch


def results(run_dir: Path) -> list[dict]:
    """Per rank: the losses of the 3 epochs, the final parameters (float32 values, exact as JSON
    floats), the global steps and the user's keys of the loaded client_state."""
    out = []
    for rank in (0, 1):
        r = torch.load(run_dir / f"rank{rank}.pt")
        out.append({"losses": r["losses"], "global_steps": r["global_steps"],
                    "epochs_done": r["client_state"]["epochs_done"],
                    "params": {k: v.flatten().tolist() for k, v in r["params"].items()}})
    return out


if __name__ == "__main__":
    here = Path(__file__).parent
    (here / "deepspeed_0.19.8.json").write_text(json.dumps(results(Path(sys.argv[1]))) + "\n")
