"""Pipeline parallelism: schedules as data (schedules.py), a simulator (simulate.py),
and an engine that runs them on real ranks (engine.py).

A schedule is a list of actions per rank; one validator checks it and one simulator
turns it plus modelled costs into a Timeline, the same picture a real run records.
"""

from .engine import Pipeline, split_model
from .schedules import SCHEDULES, Action, Schedule, peak_in_flight, schedule, validate
from .simulate import fill_bubbles, in_flight_over_time, simulate

__all__ = ["SCHEDULES", "Action", "Pipeline", "Schedule", "fill_bubbles", "in_flight_over_time",
           "peak_in_flight", "schedule", "simulate", "split_model", "validate"]
