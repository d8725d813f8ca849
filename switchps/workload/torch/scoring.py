"""Test loss and accuracy of a PyTorch module on the held-out set."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from switchps.workload.data import Dataset


class Scorer:
    """Mean test loss and accuracy of the module's current values on ``data``'s test split, in eval mode
    (BatchNorm at its running statistics). The test set is moved to ``device`` once."""

    def __init__(self, module: nn.Module, data: Dataset, device: torch.device | str, batch: int = 1024) -> None:
        self.module, self.batch = module, batch
        self.x = torch.tensor(data.x_test, dtype=torch.float32, device=device)
        self.y = torch.tensor(data.y_test, dtype=torch.int64, device=device)

    def __call__(self) -> tuple[float, float]:
        training = self.module.training  # the simulator's computer shares the module: leave its mode as found
        self.module.eval()
        loss = torch.zeros((), dtype=torch.float64, device=self.x.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.x.device)
        try:
            with torch.inference_mode():
                for i in range(0, len(self.x), self.batch):
                    x, y = self.x[i : i + self.batch], self.y[i : i + self.batch]
                    logits = self.module(x)
                    loss += F.cross_entropy(logits, y, reduction="sum").double()
                    correct += (logits.argmax(dim=-1) == y).sum()
        finally:
            self.module.train(training)
        n = len(self.x)
        return float(loss) / n, int(correct) / n
