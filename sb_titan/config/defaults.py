"""The defaults every TOML config starts from (sb_titan/config/toml.py applies a file on
top of `sb_titan_base()`); models/qwen2_5/config_registry.py exposes them to TorchTitan's
own launcher."""

from __future__ import annotations

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig

from sb_titan.data.loader import SBDataLoader
from sb_titan.data.tokenizer import TOKENIZER_DIR
from sb_titan.runtime.checkpoint import IntegrityCheckpointManager
from sb_titan.runtime.console import SBMetricsProcessor
from sb_titan.runtime.trainer import SBTrainer


def sb_titan_base() -> SBTrainer.Config:
    """Defaults every TOML config starts from (CPU friendly, fp32)."""
    config = SBTrainer.Config(
        hf_assets_path=str(TOKENIZER_DIR),
        dump_folder="./outputs",
        loss=CrossEntropyLoss.Config(),
        metrics=SBMetricsProcessor.Config(log_freq=1, enable_tensorboard=True),
        dataloader=SBDataLoader.Config(),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8),
        training=TrainingConfig(
            local_batch_size=2,
            seq_len=1024,
            steps=20,
            dtype="float32",
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        # under context parallelism: split rows by predicted sparse cost (step_shape.py)
        parallelism=ParallelismConfig(
            spmd_backend="partial_dtensor", context_parallel_load_balancer="sparse"
        ),
        checkpoint=IntegrityCheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=None,
    )
    # The plain baseline; configs turn on SAB / DST with a latency profile.
    config.sab.policy = "sequential"
    config.dst.enabled = False
    return config
