"""Context-parallel algorithms: one file each (ring, all_gather, a2a, hybrid), dispatched by
dispatch.run_cp. They import kernels only through the selector's choice."""
