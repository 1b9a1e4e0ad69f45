"""The CUDA caching allocator's one setting for the example's runs, made before torch loads.

The memory plan (memory.py) counts allocated bytes. With the allocator's fixed-size segments,
freed blocks that fit no new request stay reserved, and a run the plan fits can fail: 2b at
131,072 tokens with --ac full on an 80 GB H100 (plan 76.8 GiB) ran out of memory with 4.5 GiB
reserved but unallocated; with expandable segments it peaked at 76.2 GiB, and 8K steps ran no
slower. CUDA builds of torch may read the setting when torch is imported, so each entry script
(train.py, speed.py, memcheck.py) calls `expandable_segments()` before its `import torch`.
This module imports no torch.
"""
import os

USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments() -> None:
    """Expandable segments unless the user configured the allocator (either variable set)."""
    if not any(name in os.environ for name in USER_SETTINGS):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
