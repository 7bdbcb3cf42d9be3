"""headroom's harness: how cells are planned, run in isolation, measured, projected and stored."""
