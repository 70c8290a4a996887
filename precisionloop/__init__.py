"""precisionloop: a PyTorch training loop around a precision policy (fp32/TF32, bf16, fp16 with loss scaling, fp8)."""

from .fp8 import FP8Policy
from .loop import Checkpoints
from .memory import MemoryBreakdown, memory_breakdown
from .optim import BF16AdamW
from .policy import BF16Policy, BF16PurePolicy, FP16Policy, FP32Policy, PrecisionPolicy
from .precisions import get_policy
from .step import StepResult, TrainStats
from .trainer import Trainer, autotune
from .tuning import AutotuneResult, Candidate, default_candidates

__all__ = ["PrecisionPolicy", "FP32Policy", "BF16Policy", "BF16PurePolicy", "FP16Policy", "FP8Policy", "get_policy",
           "Trainer", "StepResult", "TrainStats", "Checkpoints", "memory_breakdown", "MemoryBreakdown", "autotune",
           "Candidate", "AutotuneResult", "default_candidates", "BF16AdamW"]
__version__ = "1.0.0"
