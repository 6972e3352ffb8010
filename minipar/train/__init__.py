"""The trainer, lesson 11: where every technique meets (a GPT trained on real text).

Files:
  data.py    the corpus (Python's own standard library by default, or any file or folder),
             a byte tokenizer, a memory-mapped token cache split by document, and a
             seeded, resumable batch sampler sharded over data-parallel ranks
"""
