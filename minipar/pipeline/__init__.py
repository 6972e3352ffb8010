"""Pipeline parallelism: schedules as data (schedules.py), a simulator (simulate.py).

A schedule is a list of actions per rank; one validator checks it and one simulator
turns it plus modelled costs into a Timeline, the same picture a real run records.
"""

from .schedules import SCHEDULES, Action, Schedule, peak_in_flight, schedule, validate
from .simulate import simulate

__all__ = ["SCHEDULES", "Action", "Schedule", "peak_in_flight", "schedule", "simulate",
           "validate"]
