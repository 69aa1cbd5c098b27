"""Private: the staging engine, its buffers and the device ledger."""
