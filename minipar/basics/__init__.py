"""First steps (lesson 00): hello world on many ranks, work split over ranks, and what
one slow worker costs everyone; with lesson 00's check (exercises.py) and the demo
(demo.py, `python -m minipar.basics`)."""

from .steps import busy_work, hello, synchronized_steps

__all__ = ["busy_work", "hello", "synchronized_steps"]
