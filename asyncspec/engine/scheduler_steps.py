"""Adaptive multi-step plans: as many decode steps per plan as the host needs to stay ahead of the device.

In the asynchronous loop the host plans, launches, reconciles and streams one plan while the device runs the
one before. When the host's work per plan is longer than the device's, the device idles between plans (the
bubble). A plan of K decode steps gives the device K steps of work for about one plan's host work, so the
smallest K with host work < K x device step hides the host. Both sides are measured on steady decode plans:

- host work per plan: the period between two plans' results less the time the host spent blocked waiting
  for the device (0 when the host is the slower side);
- device time per step: the same period less the device's idle time before the plan (CUDA events), over K.

The device's time is an overestimate when the host is the slower side: a step's kernels are enqueued one after
another, and the device waits for the last of them inside the step, between its events. So K rises only while
the device is seen idling between plans (more than RAISE_IDLE_FRACTION of the time) and the estimate asks for
more steps; it falls only when the estimate, with a wider margin, fits in fewer steps, so that a host near the
boundary does not flip between two plan lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncspec.config import EngineConfig

RAISE_MARGIN = 1.25
"""K is raised when the host's work exceeds K device steps over this factor (room for the host's jitter)."""
LOWER_MARGIN = 1.6
"""K is lowered only once the host's work times this factor fits in fewer steps."""
RAISE_IDLE_FRACTION = 0.02
"""K rises only while the device idles between plans more than this share of the time (the issue's goal for
the bubble is under 3 %)."""
SMOOTHING = 0.2
"""Weight of the newest plan in the moving averages."""
MIN_OBSERVATIONS = 4
"""Steady plans observed before the first change."""


@dataclass
class SchedulerStepsTuner:
    """Chooses the decode steps of the next plans from the measured host work per plan and device time per
    step (EngineCore feeds it steady decode plans; the scheduler applies `steps`)."""

    max_steps: int
    """The ceiling (EngineConfig.max_scheduler_steps)."""
    steps: int = 1
    """The steps the next plans may run."""
    host_seconds: float = 0.0
    """Moving average of the host's work per plan."""
    device_step_seconds: float = 0.0
    """Moving average of the device's time per step."""
    idle_fraction: float = 0.0
    """Moving average of the device's idle share of each plan's period."""
    num_observations: int = 0

    def observe(self, num_steps: int, period: float, wait: float, device_idle: float) -> int:
        """One steady plan of `num_steps` decode steps: `period` seconds since the previous plan's results,
        `wait` of them blocked on the device, `device_idle` the device's idle time before it. Returns the
        steps the next plans may run."""
        if num_steps < 1 or period <= 0.0:
            return self.steps
        host = max(period - wait, 0.0)
        device_step = max(period - device_idle, 0.0) / num_steps
        if device_step <= 0.0:
            return self.steps
        idle_fraction = min(device_idle / period, 1.0)
        if self.num_observations == 0:
            self.host_seconds, self.device_step_seconds, self.idle_fraction = host, device_step, idle_fraction
        else:
            self.host_seconds += SMOOTHING * (host - self.host_seconds)
            self.device_step_seconds += SMOOTHING * (device_step - self.device_step_seconds)
            self.idle_fraction += SMOOTHING * (idle_fraction - self.idle_fraction)
        self.num_observations += 1
        if self.num_observations < MIN_OBSERVATIONS:
            return self.steps
        ratio = self.host_seconds / self.device_step_seconds
        needed = min(max(math.ceil(ratio * RAISE_MARGIN), 1), self.max_steps)
        if needed > self.steps:
            if self.idle_fraction > RAISE_IDLE_FRACTION:
                self.steps = needed
        else:
            relaxed = min(max(math.ceil(ratio * LOWER_MARGIN), 1), self.max_steps)
            if relaxed < self.steps:
                self.steps = relaxed
        return self.steps


def initial_scheduler_steps(config: EngineConfig) -> int:
    """The steps plans start at: 1, or with speculation the ceiling. A speculating engine runs several steps
    only in plans at k = 0, which its policy takes when speculating does not pay (a large batch, low acceptance),
    comparing each k by its measured time per token. Started at 1, its rare k = 0 plans were measured one step
    a plan and charged a whole plan's host work per token, so k = 0 never looked better (an H200 host: 1.24 ms
    of host work a k = 0 token against 0.53 ms a k = 4 token) and never ran long enough to raise the count.
    From the ceiling, the tuner comes down once it has measured the device as the slower side."""
    return config.max_scheduler_steps if config.num_lookahead_tokens > 0 else 1
