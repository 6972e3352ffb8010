"""Pipeline parallelism: a plan as data (plan.py), schedules that write plans
(schedules.py), a simulator (simulate.py) and an engine that runs a plan on real ranks
(engine.py); with its benchmark (bench.py), lesson 03's checks (exercises.py) and its
demo (demo.py, `python -m minipar.pipeline`).

A schedule is a list of actions per rank; one validator checks it and one simulator
turns it plus modelled costs into a Timeline, the same picture a real run records.
"""

from .engine import Pipeline, SavedActivationMeter, split_model
from .plan import Action, Schedule, add_communication, peak_in_flight
from .schedules import SCHEDULES, schedule
from .simulate import fill_bubbles, in_flight_over_time, simulate, validate

__all__ = ["SCHEDULES", "Action", "Pipeline", "SavedActivationMeter", "Schedule",
           "add_communication", "fill_bubbles", "in_flight_over_time", "peak_in_flight",
           "schedule", "simulate", "split_model", "validate"]
