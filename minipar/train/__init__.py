"""The trainer (lesson 11): every technique composed into one training run of a GPT on
real text.

Files:
- config.py    TrainConfig (model, data, parallel, optim, train sections), TOML presets,
               load_config, check (every impossible combination is one line), to_toml
- flags.py     the command line's flags over a config (`minipar train --dp 2 ...`)
- presets/     tiny.toml (about a minute on 2 CPU cores), small.toml (about ten)
- data.py      the corpus (Python's own standard library by default, or any file or
               folder), a byte tokenizer, a memory-mapped token cache split by document,
               and a seeded, resumable batch sampler sharded over data-parallel ranks
- exercises.py lesson 11's checks: the global gradient norm over a tp x pp layout, and
               the fp16 step every rank skips when any rank's gradients overflowed
"""
