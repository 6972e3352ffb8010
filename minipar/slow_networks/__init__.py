"""Slow and unreliable networks (lesson 10): training that talks less, to fewer peers, and
survives a dead rank.

- `relaxed.py`: local SGD, CO2-style overlapped averaging, Hogwild!;
- `gossip.py`: stochastic gradient push (push-sum) and grouped all-reduce with group
  swapping;
- `checkpoint_restart.py`: checkpoint and resume after a killed rank, on fewer ranks;
  `elastic.py`: the same under torchrun --max-restarts;
- `saddle.py`: a bilinear saddle-point problem split over ranks, extragradient;
  `masha.py`: MASHA1 / MASHA2 and naive compressed extragradient; `masha_bench.py`:
  distance against bytes sent (`minipar bench masha`);
- `atom.py`: ATOM, a whole model swapped through each peer's device (`sharded.Offload`)
  and averaged by CO2 or local SGD; `atom_bench.py`: ATOM against SWARM across link
  speeds (`minipar bench atom`);
- `lab.py`: the NetworkLab's runs (a method over an emulated network, a kill);
- `exercises.py` (lesson 10's checks: push-sum, resume, error feedback), `demo.py`
  (`python -m minipar.slow_networks`).

Gradient compression, which these methods combine with, is in
`minipar.data_parallel.compression`; SWARM and SkipPipe are pipelines
(`minipar.pipeline`).
"""
