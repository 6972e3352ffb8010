"""Pipeline parallelism: a plan as data (plan.py), schedule families that write plans
(schedules.py and one file per variant), a simulator (simulate.py) and an engine that
runs a plan on real ranks (engine.py) through stages (stage.py); with its benchmark
(bench.py), lesson 03's checks (exercises.py) and its demo (demo.py,
`python -m minipar.pipeline`).

A schedule is a list of actions per rank; one validator checks it and one simulator
turns it plus modelled costs into a Timeline, the same picture a real run records.
"""

from .engine import Pipeline, StepState, split_model
from .family import ScheduleFamily
from .plan import Action, ActionKind, Schedule, add_communication, peak_in_flight
from .schedules import SCHEDULES, schedule
from .simulate import in_flight_over_time, simulate, simulate_bubble_work, validate
from .stage import SavedActivationMeter, Stage

__all__ = ["SCHEDULES", "Action", "ActionKind", "Pipeline", "SavedActivationMeter", "Schedule",
           "ScheduleFamily", "Stage", "StepState", "add_communication", "in_flight_over_time",
           "peak_in_flight", "schedule", "simulate", "simulate_bubble_work", "split_model",
           "validate"]
