"""Run by torchrun in test_train_distributed: train, then dump this rank's final weights."""

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from skipdecode.training import TrainConfig, train

if __name__ == "__main__":
    import os

    cfg = TrainConfig(**json.loads(sys.argv[1]))
    result = train(cfg)
    rank = int(os.environ.get("RANK", "0"))
    sd = {k: v.detach().clone().contiguous() for k, v in result.model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(Path(sys.argv[2]) / f"rank{rank}.safetensors"))
