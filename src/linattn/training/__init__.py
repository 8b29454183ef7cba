"""Training: a config, tasks, a loop, checkpoints that resume exactly, data and sequence parallelism.

    config -> tasks -> (model) -> loop -> checkpointing, metrics; progress shows what the loop emits.
See training.loop for what a step does and design §10 for the data flow.
"""

from ..models.checkpoint import CheckpointError
from .checkpointing import (CHECKPOINTS, LAST, TRAINER_FORMAT, TRAINER_FORMAT_VERSION, TRAINER_JSON, TRAINER_TENSORS,
                            find_checkpoint, load_training_checkpoint, read_trainer_doc, save_training_checkpoint)
from .config import DISTRIBUTED, DTYPES, RESUMABLE_CHANGES, TASKS, TrainConfig, build_model, load_config_file, make_task
from .loop import CONFIG_OUT, EXIT_DIVERGED, EXIT_INTERRUPTED, StepInfo, TrainResult, train
from .metrics import LOSS_PNG, METRICS, plot_metrics, read_metrics
from .optim import lr_factor
from .tasks import Task, evaluate

__all__ = ["TASKS", "EXIT_DIVERGED", "EXIT_INTERRUPTED", "CheckpointError", "TrainConfig", "TrainResult", "StepInfo",
           "build_model", "evaluate", "find_checkpoint", "load_config_file", "load_training_checkpoint", "make_task",
           "plot_metrics", "read_metrics", "read_trainer_doc", "save_training_checkpoint", "train",
           # also importable, as before: constants of the files a run writes, the schedule, the Task base
           "CHECKPOINTS", "CONFIG_OUT", "DISTRIBUTED", "DTYPES", "LAST", "LOSS_PNG", "METRICS", "RESUMABLE_CHANGES",
           "TRAINER_FORMAT", "TRAINER_FORMAT_VERSION", "TRAINER_JSON", "TRAINER_TENSORS", "Task", "lr_factor"]
