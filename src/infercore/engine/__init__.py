"""The reference engine: continuous batching, chunked prefill, prefix caching, preemption."""

from .engine import Engine, EngineConfig
from .params import SamplingParams
from .request import ClassificationOutput, RequestMetrics, RequestOutput
from .scheduler import ScheduledBatch, Scheduler

__all__ = ["ClassificationOutput", "Engine", "EngineConfig", "RequestMetrics", "RequestOutput", "SamplingParams",
           "ScheduledBatch", "Scheduler"]
