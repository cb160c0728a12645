"""scripts/bench.py by part: probes (timing hooks), closed_form (expected counts), recipes (one tiny
recipe), published (published settings), gpu (GPU mode), report (JSON / markdown)."""
