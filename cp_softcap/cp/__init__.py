"""Context-parallel algorithms, one file per comm= value (ring, all_gather, a2a, a2a_p2p, auto).
Each autograd.Function takes (q, k, v, plan); api.ALGORITHMS maps comm names to them."""
