"""precisionloop: a PyTorch training step around a precision policy (fp32/TF32, bf16, fp16 with loss scaling)."""

from .tuning import AutotuneResult, Candidate, default_candidates
from .batches import normalize_uint8
from .fp8 import FP8Policy
from .memory import MemoryBreakdown, memory_breakdown
from .policy import BF16Policy, BF16PurePolicy, FP16Policy, FP32Policy, PrecisionPolicy
from .precisions import get_policy
from .trainer import StepResult, Trainer, TrainStats, autotune

__all__ = [
    "PrecisionPolicy",
    "FP32Policy",
    "BF16Policy",
    "BF16PurePolicy",
    "FP16Policy",
    "FP8Policy",
    "get_policy",
    "Trainer",
    "StepResult",
    "TrainStats",
    "autotune",
    "Candidate",
    "AutotuneResult",
    "default_candidates",
    "memory_breakdown",
    "MemoryBreakdown",
    "normalize_uint8",
]
__version__ = "0.2.0"
