"""The embedded engine's machinery, one module a concept.

- ``context``: the seam, the llama.cpp calls one context answers (``Context``);
  ``native`` makes them on a real context.
- ``jobs``: a request as a job, its state, and the events it posts.
- ``scoring``: candidates as a token trie decoded in one step.
- ``cache``: sequence ids, cells, idle prefixes and the host shelf, and which
  prompt a new job starts from (``CacheManager``).
- ``scheduler``: what each step holds and what its results mean (``Scheduler``).
- ``steps``: the thread that carries out the steps (``StepThread``).
- ``models``: what is loaded, models and versions.

``engines.llama_cpp`` is the facade the rest of batchyard calls.
"""
