"""Measurement tools for the Gemma2 example's training step (examples/gemma2): the step's speed
and MFU per fused piece (speed), its peak memory against the plan (memcheck, measure), the plan's
table (plan_table), and where the GPU waits (gaps)."""
