"""comm="a2a+p2p": all-to-all (Ulysses) inside an inner group, ring across an outer group.

The steps are comm="a2a"'s (cp/a2a.py), with the whole-sequence kernel call replaced by a ring
(cp/ring.py) across the outer group: after the all-to-all each inner group holds its members'
tokens in the zigzag layout of the outer ring, for its share of the heads. The ring's gradients
are float32 sums and travel back through the all-to-all as such.

Groups: a pair (a2a_group, ring_group) from make_hybrid_groups, or a 2-D DeviceMesh with dims
(ring, a2a) (groups.py). The CP rank is ring_rank * a2a_size + a2a_rank (hybrid_rank).
"""
from __future__ import annotations

from .a2a import a2a_function
from .ring import ring_backward, ring_forward

A2AP2PAttention = a2a_function("A2AP2PAttention", ring_forward, ring_backward)
