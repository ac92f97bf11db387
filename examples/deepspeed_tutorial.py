"""DeepSpeed's getting-started loop, run by tinyscale or by DeepSpeed itself (the same file).

    torchrun --nproc-per-node 2 examples/deepspeed_tutorial.py --deepspeed --deepspeed_config ds.json --out DIR
    DS_ACCELERATOR=cpu TUTORIAL_ENGINE=deepspeed deepspeed --num_gpus 2 examples/deepspeed_tutorial.py ...

The shape of DeepSpeed's tutorial (deepspeed.ai/getting-started): argparse with
`add_config_arguments`, `initialize` with `training_data`, the forward/backward/step loop,
`save_checkpoint` with a tag and `client_state`, `load_checkpoint`. The one line that differs
between the two runs is the import (TUTORIAL_ENGINE). It trains one epoch, saves, trains a
second, loads the save and trains the second again (a resume must repeat it exactly), and each
rank writes its micro-batch losses and final parameters to DIR/rank{r}.pt.
`pytest -k deepspeed_api` runs it both ways and compares.
"""

import argparse
import importlib
import os

import torch
from torch.utils.data import TensorDataset

deepspeed = importlib.import_module(os.environ.get("TUTORIAL_ENGINE", "tinyscale.deepspeed"))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))  # (N, 4) logits


def main():
    parser = argparse.ArgumentParser(description="DeepSpeed's getting-started loop")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--out", required=True, help="folder for checkpoints and each rank's results")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)  # every rank builds the same data and model
    dataset = TensorDataset(torch.randn(40, 8), torch.randint(0, 4, (40,)))
    net = Net()  # float32: DeepSpeed reduces no float64 gradients
    criterion = torch.nn.CrossEntropyLoss()
    engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=dataset)

    def epoch():
        losses = []
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(engine.device), labels.to(engine.device)
            loss = criterion(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    first = epoch()
    ckpt = os.path.join(args.out, "ckpt")
    engine.save_checkpoint(ckpt, tag="epoch1", client_state={"epochs_done": 1})
    second = epoch()
    path, client_state = engine.load_checkpoint(ckpt)  # the tag in ckpt/latest
    again = epoch()
    rank = int(os.environ.get("RANK", 0))
    state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    torch.save({"losses": [first, second, again], "client_state": client_state, "path": path,
                "global_steps": engine.global_steps, "params": state}, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
