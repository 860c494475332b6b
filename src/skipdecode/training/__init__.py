"""Skip-aware fine-tuning: teacher forcing through the same skipping forward pass as generation.

- ``config``: ``TrainConfig`` (every setting, validated in one place), the run's result, its schedules;
- ``batch``: the layout that makes training run exactly what generation runs, the objective
  (cross-entropy, optional self-distillation), the data order;
- ``loop``: ``train()`` (see its module docstring for the alignment and fault tolerance);
- ``state``: checkpoints (atomic, weights-only) and the run directory;
- ``dist``: torchrun processes, DDP and FSDP2;
- ``qat``: int4 quantization-aware training (block linears forward through their int4 rounding).
"""

from .batch import IGNORE, Batch, active_lengths, batch_loss_sum, batch_objective, global_batch_indices, make_batch
from .config import (TrainConfig, TrainError, TrainResult, build_schedules, draw_schedule, schedule_draws,
                     schedule_for_speedup)
from .loop import measure_step_time, prepare_model, train

__all__ = ["IGNORE", "Batch", "TrainConfig", "TrainError", "TrainResult", "active_lengths", "batch_loss_sum",
           "batch_objective", "build_schedules", "draw_schedule", "global_batch_indices", "make_batch",
           "measure_step_time", "prepare_model", "schedule_draws", "schedule_for_speedup", "train"]
