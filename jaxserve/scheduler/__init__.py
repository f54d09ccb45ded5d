"""Scheduling layer (no JAX): who runs this step and how many tokens each."""

from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from jaxserve.scheduler.scheduler import Scheduler

__all__ = ["ScheduledChunk", "SchedulerOutput", "Scheduler"]
