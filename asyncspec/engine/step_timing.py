"""Where a step's wall time goes: the CPU planning it, the gap between launches, the device idle.

The asynchronous loop exists to shrink the device's idle time between steps (the bubble); these
counters say how large it is. EngineCore owns one StepTimings and feeds it every step; the Prometheus
exporter reads the totals and the last step's values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class StepTimings:
    """Running totals (seconds) over the steps an engine ran, plus the last step's values."""

    num_steps: int = 0
    """Steps timed."""
    scheduling_seconds: float = 0.0
    """CPU time planning steps (`Scheduler.schedule`)."""
    execute_seconds: float = 0.0
    """Wall time from a step's launch to its results on the host (in the asynchronous loop this
    includes the time it queued behind the step before it)."""
    update_seconds: float = 0.0
    """CPU time reconciling results (`Scheduler.update_from_output`)."""
    launch_gap_seconds: float = 0.0
    """Time between consecutive steps' launches (the first step starts no gap)."""
    device_idle_seconds: float = 0.0
    """Device idle between the end of one step's work and the start of the next: CUDA events on a GPU;
    on the CPU, where the worker plays the device, the host time between two executions."""
    last_scheduling_seconds: float = 0.0
    last_execute_seconds: float = 0.0
    last_launch_gap_seconds: float = 0.0
    last_device_idle_seconds: float = 0.0
    _last_launch: float | None = None
    _last_execute_end: float | None = None

    def record(
        self,
        schedule_start: float,
        launch: float,
        execute_end: float,
        update_end: float,
        device_idle: float | None,
    ) -> None:
        """One step's timestamps (time.perf_counter) and, where the device measured it, its idle
        time before this step (None: take the host's gap since the previous execution ended)."""
        self.num_steps += 1
        self.last_scheduling_seconds = launch - schedule_start
        self.scheduling_seconds += self.last_scheduling_seconds
        self.last_execute_seconds = execute_end - launch
        self.execute_seconds += self.last_execute_seconds
        self.update_seconds += update_end - execute_end
        gap = launch - self._last_launch if self._last_launch is not None else 0.0
        self.last_launch_gap_seconds = gap
        self.launch_gap_seconds += gap
        if device_idle is None:
            device_idle = launch - self._last_execute_end if self._last_execute_end is not None else 0.0
        self.last_device_idle_seconds = device_idle
        self.device_idle_seconds += device_idle
        self._last_launch, self._last_execute_end = launch, execute_end

    def reset_gaps(self) -> None:
        """The engine went idle (no requests): the wait until the next request is not a bubble."""
        self._last_launch = self._last_execute_end = None

    def as_stats(self) -> dict[str, float]:
        return {
            "num_timed_steps": self.num_steps,
            "step_scheduling_seconds_total": self.scheduling_seconds,
            "step_execute_seconds_total": self.execute_seconds,
            "step_update_seconds_total": self.update_seconds,
            "step_launch_gap_seconds_total": self.launch_gap_seconds,
            "device_idle_seconds_total": self.device_idle_seconds,
            "last_step_scheduling_seconds": self.last_scheduling_seconds,
            "last_step_execute_seconds": self.last_execute_seconds,
            "last_step_launch_gap_seconds": self.last_launch_gap_seconds,
            "last_step_device_idle_seconds": self.last_device_idle_seconds,
        }


@dataclass
class StartupTimings:
    """Where an engine's construction went, in seconds (stats: `startup_*`)."""

    load_seconds: float = 0.0
    """The model runner: model config and weights (in each rank's process under tensor parallelism)."""
    kv_cache_seconds: float = 0.0
    """Memory profiling, the KV pool and CUDA-graph capture."""
    warm_up_seconds: float = 0.0
    """The start-up warm-up's dummy requests (CUDA only; warm_up.py)."""
    warm_up_steps: int = 0
    """Engine steps the warm-up ran."""

    def as_stats(self) -> dict[str, float]:
        """Each field as `startup_<field>`."""
        return {f"startup_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}
