"""Head pages: page space, page tables, per-request page bookkeeping, compaction copies, KV layouts."""
